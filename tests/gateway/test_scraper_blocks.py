"""KV capacity from vLLM arrives in vLLM's blocks; the core counts in its own `kv.block_size`."""

from __future__ import annotations

from typing import Any

import pytest

from llmflow.gateway.scraper import Scraper


class _Recorder:
    """Stands in for the runtime host: keeps what the scraper reports."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.on_health: Any = None

    def scrape_ok(self, backend: str, began_us: int, **values: Any) -> None:
        self.seen = values


@pytest.mark.parametrize(
    ("vllm_block", "core_block", "expected"),
    [(128, 16, 256), (16, 16, 32), (16, 32, 16)],  # CPU vLLM, GPU vLLM, a coarser core
)
def test_capacity_is_counted_in_the_cores_blocks(
    vllm_block: int, core_block: int, expected: int
) -> None:
    policy = _Recorder()
    scraper = Scraper(policy, None, {"b": "http://x"}, 0.1, block_size=core_block)  # type: ignore[arg-type]
    scraper._record(
        scraper.states["b"], {"num_gpu_blocks": 32.0, "block_size": float(vllm_block)}, 0
    )
    assert policy.seen["kv_blocks"] == expected


def test_capacity_without_a_block_size_is_passed_as_is() -> None:
    policy = _Recorder()
    scraper = Scraper(policy, None, {"b": "http://x"}, 0.1)  # type: ignore[arg-type]
    scraper._record(scraper.states["b"], {"num_gpu_blocks": 32.0}, 0)
    assert policy.seen["kv_blocks"] == 32
