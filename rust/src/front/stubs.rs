#![allow(clippy::all, clippy::pedantic)]
// TEMPORARY: the interface governed.rs expects from front-prepare's modules (replaced at merge).
pub mod prepare {
    #[derive(Debug, Clone, Copy)]
    pub enum Endpoint {
        Chat,
        Completions,
    }
    #[derive(Debug, Clone, Default)]
    pub struct Checks;
    #[derive(Debug, Clone, Default)]
    pub struct Prepared {
        pub model: String,
        pub stream: bool,
        pub choices: u32,
        pub include_usage: bool,
        pub continuous_usage: bool,
        pub unstreamed: bool,
        pub prompt_tokens: u64,
        pub generated: u64,
        pub max_tokens: Option<u64>,
        pub prefix_hashes: Option<Vec<u64>>,
        pub fingerprint: u64,
    }
    impl Prepared {
        pub fn path(&self) -> &'static str {
            "/v1/chat/completions"
        }
    }
    pub fn prepare(_e: Endpoint, _raw: &[u8], _c: &Checks) -> Option<Prepared> {
        None
    }
    pub fn upstream_body(_p: &Prepared, _priority: Option<i64>, _max: Option<u64>) -> Vec<u8> {
        Vec::new()
    }
}
pub mod auth {
    pub struct Identity {
        pub tenant: String,
        pub tier: String,
    }
    pub struct KeyRing;
    impl KeyRing {
        pub fn authenticate(&self, _h: Option<&[u8]>) -> Option<Identity> {
            None
        }
    }
}
pub mod signals {
    pub struct Signals {
        pub retries: Option<u32>,
        pub deadline_ms: Option<u64>,
    }
    pub fn read_signals(_h: &[(String, Vec<u8>)]) -> Result<Signals, ()> {
        Err(())
    }
}
pub mod reply {
    use crate::relay::Failure;
    pub fn error_reply(
        _id: u64,
        _status: u16,
        reason: &str,
        _ra: Option<u32>,
        _f: Option<&Failure>,
        _ka: bool,
    ) -> (Vec<u8>, String) {
        (Vec::new(), reason.to_owned())
    }
    pub fn in_band_error(_f: &Failure) -> Vec<u8> {
        Vec::new()
    }
    pub fn notice_frame(
        _p: &super::prepare::Prepared,
        _t: Option<&str>,
        _r: &str,
        _id: u64,
    ) -> Vec<u8> {
        Vec::new()
    }
}
