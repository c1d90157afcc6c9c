pub mod json;
pub mod prepare;
pub mod prompt;
pub mod request;
