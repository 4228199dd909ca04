//! The HTTP/1.1 server loop: hyper, with a timer so that a client gets a bounded time to
//! send a request's headers.
//!
//! `axum::serve` sets no header read timeout, so a client that sends its headers one byte
//! a minute holds a connection and its task for as long as it likes (a slowloris). The
//! body has its own deadline where a handler reads one (`create_coupon`), and every
//! request but a purchase is bounded by the request timeout (`http::observe`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How long, once stopped, the server keeps answering on the connections it has, each
/// answer telling its client to close the connection, before it closes the idle ones.
pub const LAME_DUCK: Duration = Duration::from_secs(1);

/// The open connections, and a wake-up when one closes.
#[derive(Default)]
struct OpenConnections {
    count: AtomicUsize,
    closed: Notify,
}

/// Counts one connection as open until dropped.
struct Open(Arc<OpenConnections>);

impl Open {
    fn new(open: &Arc<OpenConnections>) -> Self {
        open.count.fetch_add(1, Ordering::SeqCst);
        Open(open.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.closed.notify_waiters();
    }
}

/// Serves `app` on `listener` until `stop` is cancelled, then stops gracefully: no new
/// connection is accepted, requests in flight finish, and every request that reached the
/// server gets its answer. The caller bounds the whole (the shutdown timeout).
///
/// Closing an idle keep-alive connection races its client, which may have just sent a
/// request on it: the client then sees the connection cut with its request unanswered (a
/// review saw all 128 connections of a load generator end so). So for [`LAME_DUCK`] the
/// server keeps answering on the connections it has, and every answer carries
/// `Connection: close`: each client closes its connection after its next answer, and
/// opens a new one, which is refused. Only connections that sent nothing for that long
/// are then closed.
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
    let draining = Arc::new(AtomicBool::new(false));
    let app = app.layer(axum::middleware::map_response({
        let draining = draining.clone();
        move |mut response: Response| {
            let draining = draining.load(Ordering::SeqCst);
            async move {
                if draining {
                    response.headers_mut().insert(
                        axum::http::header::CONNECTION,
                        axum::http::HeaderValue::from_static("close"),
                    );
                }
                response
            }
        }
    }));
    let open = Arc::new(OpenConnections::default());
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
        let counted = Open::new(&open);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "an HTTP connection ended with an error");
            }
            drop(counted);
        });
    }
    drop(listener);
    draining.store(true, Ordering::SeqCst);
    let lame_duck_ends = tokio::time::Instant::now() + LAME_DUCK;
    loop {
        let closed = open.closed.notified();
        if open.count.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::select! {
            () = closed => {}
            () = tokio::time::sleep_until(lame_duck_ends) => break,
        }
    }
    graceful.shutdown().await;
}
