//! Turns at reading a request: in a flood, a protected tier's request is not read, sent
//! upstream and answered behind thousands of refusals.
//!
//! tokio runs ready tasks first in, first out. When 5,000 requests land at once, every
//! connection's task is ready together, and each costs ~15 µs to read, judge and answer (a
//! 429 mostly). A VIP request's every step (its read, its upstream send, its last chunk, its
//! reply) is a task woken behind whatever is ready at that moment: behind ~90 ms of refusals
//! at worst, for each step.
//!
//! So a connection not known to be a protected tier's takes a turn before its next request is
//! read (`Intake::turn`). Turns come in rounds of `per_round`; once a round's turns are
//! taken, the next round starts only after every task ready at that moment has run (the
//! pump goes to the back of the run queue, and waits for the runtime's shared queue, where a
//! burst of wake-ups past the worker's own queue lands, to be empty). A VIP step
//! then waits behind one round's requests, not behind the crowd, and the crowd's requests
//! are still read in order and as fast as the runtime runs them: a turn is taken and spent
//! at once, never held, so a slow client holds nothing and the count of requests in progress
//! is not bounded here (the runtime's cap and queue bound that).
//!
//! Which connections skip the turns is the runtime's to say: one whose last request the
//! runtime took as a protected tier's (`Governor::is_protected`), from its authenticated key.
//! A connection's first request takes a turn, whoever sends it.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;

use tokio::sync::{watch, Notify, Semaphore};

/// Requests read per round and per worker thread: a round is ~0.25 ms of refusals at ~15 µs
/// each, what a VIP step may wait behind; the pump's round trip (two polls) is paid once per
/// this many requests.
pub const TURNS_PER_WORKER: usize = 16;

/// The turns of the current round, and the pump that starts the next.
pub struct Intake {
    turns: Semaphore,
    /// The round's last turn was taken.
    spent: Notify,
    per_round: usize,
}

impl Intake {
    /// Turns in rounds of `per_round`; the pump runs on `runtime` until `closed` is set.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        per_round: usize,
        mut closed: watch::Receiver<bool>,
    ) -> Arc<Self> {
        let intake = Arc::new(Self {
            turns: Semaphore::new(per_round),
            spent: Notify::new(),
            per_round,
        });
        let pump = Arc::clone(&intake);
        runtime.spawn(async move {
            tokio::select! {
                () = pump.pump() => {}
                _ = closed.wait_for(|c| *c) => {}
            }
        });
        intake
    }

    /// Wait for a turn (first come, first served) and spend it.
    pub async fn turn(&self) {
        let turn = self
            .turns
            .acquire()
            .await
            .expect("the semaphore is never closed");
        turn.forget();
        if self.turns.available_permits() == 0 {
            self.spent.notify_one();
        }
    }

    async fn pump(&self) {
        loop {
            self.spent.notified().await;
            // Woken by the task that took the last turn, this task runs next (tokio's LIFO
            // slot): first go to the back of the run queue, so that what is ready now runs
            // before the next round's requests.
            back_of_the_run_queue().await;
            // A burst of wake-ups past the worker's local queue waits in the runtime's shared
            // queue, which a busy worker serves one task per ~200 µs: until it is empty, no
            // new round (a task left there would wait behind round after round). Waiting for
            // the worker's next look at the I/O driver lets the local queue run dry, and a
            // worker with nothing local takes the shared queue's tasks in batches.
            while tokio::runtime::Handle::current()
                .metrics()
                .global_queue_depth()
                > 0
            {
                tokio::task::yield_now().await;
            }
            let left = self.turns.available_permits();
            self.turns.add_permits(self.per_round.saturating_sub(left));
        }
    }
}

/// Yield to every task ready now. (`tokio::task::yield_now` defers to the I/O driver's next
/// poll, which may wake a thousand more of the crowd first; a task that wakes itself goes to
/// the back of the queue as it is.)
async fn back_of_the_run_queue() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// How many of 64 crowd requests, all ready at once, are read before a VIP task made
    /// ready just after them runs, with turns in rounds of `per_round`.
    fn read_before_the_vip(per_round: usize) -> usize {
        let rt = runtime();
        let (_closed, watching) = watch::channel(false);
        let intake = Intake::start(rt.handle(), per_round, watching);
        let read = Arc::new(AtomicUsize::new(0));
        let test = async move {
            let mut crowd = Vec::new();
            for _ in 0..64 {
                let (intake, read) = (Arc::clone(&intake), Arc::clone(&read));
                crowd.push(tokio::spawn(async move {
                    intake.turn().await;
                    read.fetch_add(1, Ordering::SeqCst);
                }));
            }
            let seen = Arc::clone(&read);
            let vip = tokio::spawn(async move { seen.load(Ordering::SeqCst) });
            // tokio runs the task woken last first (its LIFO slot), as it runs the last of a
            // batch the I/O driver wakes: this one, so that the VIP is behind the crowd.
            tokio::spawn(async {});
            let saw = vip.await.unwrap();
            for task in crowd {
                task.await.unwrap();
            }
            assert_eq!(
                read.load(Ordering::SeqCst),
                64,
                "every crowd request got its turn"
            );
            saw
        };
        // On the worker, as the front's tasks run (not on the thread that blocks).
        rt.block_on(rt.spawn(test)).unwrap()
    }

    #[test]
    fn a_task_ready_behind_the_crowd_waits_for_one_round_only() {
        assert!(
            read_before_the_vip(64) >= 60,
            "without rounds, the crowd runs first"
        );
        let read = read_before_the_vip(4);
        assert!(read <= 8, "the VIP task ran after {read} crowd requests");
    }

    #[test]
    fn turns_are_taken_in_order_of_asking() {
        let rt = runtime();
        let (_closed, watching) = watch::channel(false);
        let intake = Intake::start(rt.handle(), 2, watching);
        let order = rt
            .block_on(rt.spawn(async move {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let mut tasks = Vec::new();
                for i in 0..10 {
                    let (intake, tx) = (Arc::clone(&intake), tx.clone());
                    tasks.push(tokio::spawn(async move {
                        intake.turn().await;
                        tx.send(i).unwrap();
                    }));
                    // Each asks before the next is spawned.
                    tokio::task::yield_now().await;
                }
                for task in tasks {
                    task.await.unwrap();
                }
                drop(tx);
                let mut order = Vec::new();
                while let Some(i) = rx.recv().await {
                    order.push(i);
                }
                order
            }))
            .unwrap();
        assert_eq!(order, (0..10).collect::<Vec<_>>());
    }
}
