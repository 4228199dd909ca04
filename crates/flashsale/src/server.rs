//! The HTTP/1.1 server loop: hyper, with a timer so that a client gets a bounded time to
//! send a request's headers.
//!
//! `axum::serve` sets no header read timeout, so a client that sends its headers one byte
//! a minute holds a connection and its task for as long as it likes (a slowloris). The
//! body has its own deadline where a handler reads one (`create_coupon`), and every
//! request but a purchase is bounded by the request timeout (`http::observe`).

use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `app` on `listener` until `stop` is cancelled, then lets the requests in flight
/// finish. The caller bounds that wait (the shutdown timeout).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_read_timeout: Duration,
    stop: CancellationToken,
) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of file descriptors, say: back off instead of spinning.
                tracing::warn!(error = %err, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let connection =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "an HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
