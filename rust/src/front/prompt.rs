//! A prompt's size and block hashes before any backend sees it: `gateway/tokens.py` and
//! `gateway/prefix.py`, the same arithmetic on the same bytes.
//!
//! Text is costed at `bytes_per_token` UTF-8 bytes a token (rounded up), token ids count
//! exactly; a chat adds the template's overhead. The block hashes are the core's keyed chain
//! (`routing::keyed_chain_hashes`) over the bytes `prefix.py` lays out, so a request hashed
//! here and one hashed by Python in the same process route alike.

use super::json::{self, Json, Style};
use super::request::{Content, Message, Prompt};

const PER_MESSAGE: u64 = 4; // role markers and separators a chat template adds per message
const PER_CHAT: u64 = 3; // the assistant header that primes the reply
const PER_IMAGE: u64 = 576; // a typical vision encoder's patch count (LLaVA-1.5 at 336 px)
const MAX_BLOCKS: usize = 4096; // a chain longer than any KV cache holds routes no better

/// `text_tokens`: UTF-8 bytes over `bytes_per_token`, rounded up (Python's float division).
pub fn text_tokens(text: &str, bytes_per_token: f64) -> u64 {
    (text.len() as f64 / bytes_per_token).ceil() as u64
}

/// Each prompt's tokens (`chat_prompt_tokens`, or `completion_prompts_tokens`: one a prompt).
pub fn prompt_tokens(prompt: &Prompt<'_>, bytes_per_token: f64) -> Vec<u64> {
    match prompt {
        Prompt::Chat(messages) => vec![
            PER_CHAT
                + messages
                    .iter()
                    .map(|m| PER_MESSAGE + content_tokens(&m.content, bytes_per_token))
                    .sum::<u64>(),
        ],
        Prompt::Texts(texts) => texts
            .iter()
            .map(|t| text_tokens(t, bytes_per_token))
            .collect(),
        Prompt::Ids(ids) => ids.iter().map(|p| p.len() as u64).collect(),
    }
}

fn content_tokens(content: &Content<'_>, bytes_per_token: f64) -> u64 {
    match content {
        Content::None => 0,
        Content::Text(text) => text_tokens(text, bytes_per_token),
        Content::Parts(parts) => parts
            .iter()
            .map(|part| match (part.get("text"), part.get("type")) {
                (Some(Json::Str(text)), _) => text_tokens(text, bytes_per_token),
                // `str(part.get("type", ""))`: only a string can start with "image".
                (_, Some(Json::Str(kind))) if kind.starts_with("image") => PER_IMAGE,
                _ => 0,
            })
            .sum(),
    }
}

/// The prompt's chained block hashes (`chat_prefix_hashes` / `completion_prefix_hashes`):
/// a chat's messages as `<role>` then content, a completion's first prompt by its bytes or
/// by `block_size` ids at a time.
pub fn prefix_hashes(prompt: &Prompt<'_>, block_size: u64, bytes_per_token: f64) -> Vec<u64> {
    let text_chunk = ((block_size as f64 * bytes_per_token).round_ties_even() as usize).max(1);
    match prompt {
        Prompt::Chat(messages) => chain(&chat_bytes(messages), text_chunk),
        Prompt::Texts(texts) => chain(texts[0].as_bytes(), text_chunk),
        Prompt::Ids(ids) => {
            let bytes: Vec<u8> = ids[0]
                .iter()
                .flat_map(|id| match id {
                    Json::Int(i) => (*i as u32).to_le_bytes(),
                    _ => unreachable!("validated as token ids"),
                })
                .collect();
            chain(&bytes, 4 * block_size as usize)
        }
    }
}

fn chain(data: &[u8], chunk: usize) -> Vec<u64> {
    crate::routing::keyed_chain_hashes(data, chunk, MAX_BLOCKS)
}

/// `<role>` and the content of each message; typed parts as `json.dumps(content,
/// sort_keys=True, separators=(",", ":"))` writes them.
fn chat_bytes(messages: &[Message<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    let style = Style {
        ascii: true,
        sort_keys: true,
        compact: true,
    };
    for message in messages {
        out.push(b'<');
        out.extend_from_slice(message.role.as_bytes());
        out.push(b'>');
        match &message.content {
            Content::None => {}
            Content::Text(text) => out.extend_from_slice(text.as_bytes()),
            Content::Parts(parts) => {
                out.push(b'[');
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    json::write(&mut out, part, style);
                }
                out.push(b']');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::decode::read;
    use crate::front::request::{chat, completion};

    // Ceiling of bytes over bytes_per_token; CJK counts its UTF-8 bytes.
    #[test]
    fn text_estimate() {
        assert_eq!(text_tokens("", 4.0), 0);
        assert_eq!(text_tokens("abcd", 4.0), 1);
        assert_eq!(text_tokens("abcde", 4.0), 2);
        assert_eq!(text_tokens("日本", 4.0), 2); // 6 bytes
        assert_eq!(text_tokens("abc", 0.75), 4);
    }

    // Template overhead, text parts, images; a part without text or image type costs nothing.
    #[test]
    fn chat_estimate() {
        let body = read(
            br#"{"model":"m","messages":[{"role":"system","content":"abcdefgh"},
            {"role":"user","content":[{"type":"text","text":"abcd"},
            {"type":"image_url","image_url":{"url":"x"}},{"type":"input_audio"}]},
            {"role":"assistant","content":null}]}"#,
        )
        .unwrap();
        let request = chat(&body).unwrap();
        assert_eq!(
            prompt_tokens(&request.prompt, 4.0),
            vec![3 + 4 + 2 + 4 + 1 + 576 + 4]
        );
    }

    // Token ids count exactly, one entry per prompt of a batch.
    #[test]
    fn completion_estimate() {
        let body = read(br#"{"model":"m","prompt":[[1,2,3],[4]]}"#).unwrap();
        assert_eq!(
            prompt_tokens(&completion(&body).unwrap().prompt, 4.0),
            vec![3, 1]
        );
    }

    // Ids hash as 4-byte little-endian words, block_size at a time, the first prompt only;
    // a shared leading text shares its leading hashes.
    #[test]
    fn hashes_chain_over_the_layout() {
        let ids = read(br#"{"model":"m","prompt":[[1,2,3,4,5],[9]]}"#).unwrap();
        let hashes = prefix_hashes(&completion(&ids).unwrap().prompt, 2, 4.0);
        let words: Vec<u8> = [1u32, 2, 3, 4, 5]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        assert_eq!(
            hashes,
            crate::routing::keyed_chain_hashes(&words, 8, MAX_BLOCKS)
        );
        assert_eq!(hashes.len(), 2);
        let a = read(br#"{"model":"m","prompt":"0123456789abcdef-one-abc"}"#).unwrap();
        let b = read(br#"{"model":"m","prompt":"0123456789abcdef-two-abc"}"#).unwrap();
        let (a, b) = (completion(&a).unwrap(), completion(&b).unwrap());
        let (ha, hb) = (
            prefix_hashes(&a.prompt, 2, 4.0),
            prefix_hashes(&b.prompt, 2, 4.0),
        );
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[2], hb[2]);
    }

    // A chat lays out `<role>` then content; parts as sorted, ASCII-escaped compact JSON.
    #[test]
    fn chat_layout() {
        let body = read(
            r#"{"model":"m","messages":[{"role":"u","content":[{"type":"text","text":"é","a":1.5}]},{"role":"a"}]}"#
                .as_bytes(),
        )
        .unwrap();
        let Prompt::Chat(messages) = chat(&body).unwrap().prompt else {
            panic!()
        };
        assert_eq!(
            chat_bytes(&messages),
            br#"<u>[{"a":1.5,"text":"\u00e9","type":"text"}]<a>"#
        );
    }
}
