pub mod auth;
pub mod json;
pub mod prepare;
pub mod prompt;
pub mod reply;
pub mod request;
pub mod signals;
