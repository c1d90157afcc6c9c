//! The native front door (placeholder for the integrator's branch; front-http owns this file).
pub mod governed;
pub mod owner;
pub mod record;
mod stubs;
pub use stubs::{auth, prepare, reply, signals};

pub struct Conn {
    pub stream: tokio::net::TcpStream,
    pub peer: std::net::SocketAddr,
    pub buffered: bytes::BytesMut,
}
pub struct Request {
    pub method: String,
    pub target: String,
    pub version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: bytes::Bytes,
    pub keep_alive: bool,
}
pub enum Outcome {
    Served(Option<Conn>),
    Declined(Request, Conn),
}
pub trait Native: Send + Sync + 'static {
    fn serve(
        self: std::sync::Arc<Self>,
        request: Request,
        conn: Conn,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;
}
