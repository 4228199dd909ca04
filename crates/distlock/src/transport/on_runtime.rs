//! A request to a store other than Redis, run the one way each store's link runs them:
//! in a task on the client's own runtime (a driver's sockets belong to the runtime that
//! opened them, and a caller's runtime may end or stop being driven), within a time limit,
//! its failure classified by the store.

use std::future::Future;
use std::time::Duration;

use tokio::runtime::Handle;

use crate::error::{Error, Result, StoreFailure};

/// Where a request goes, for its errors: the store's name and the address the client
/// connected to.
#[derive(Clone, Copy)]
pub(crate) struct StoreAt<'a> {
    pub(crate) store: &'static str,
    pub(crate) target: &'a str,
}

/// Runs `request` on `runtime` and waits for it at most `limit`. A request still running
/// when the caller goes away finishes there. `classify` turns the driver's error into
/// the crate's; a request with no answer in time is a connection failure, worded
/// "no answer within …".
pub(crate) async fn run<T, E, Fut>(
    runtime: &Handle,
    at: StoreAt<'_>,
    limit: Duration,
    request: Fut,
    classify: impl FnOnce(&str, E) -> Error,
) -> Result<T>
where
    Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    let running = runtime.spawn(async move { tokio::time::timeout(limit, request).await });
    match running.await {
        Ok(Ok(answer)) => answer.map_err(|err| classify(at.target, err)),
        Ok(Err(_elapsed)) => Err(no_answer(at, limit)),
        Err(err) => Err(Error::Runtime(std::io::Error::other(format!(
            "the client's runtime did not run the request (was the client shut down?): {err}"
        )))),
    }
}

/// The failure of a request that got no answer within `limit`.
pub(crate) fn no_answer(at: StoreAt<'_>, limit: Duration) -> Error {
    Error::Store {
        store: at.store,
        target: at.target.to_owned(),
        failure: StoreFailure::Connection,
        detail: format!("{NO_ANSWER} within {limit:?}"),
    }
}

/// How [`no_answer`] begins, for a caller that tells a timeout from other failures.
pub(crate) const NO_ANSWER: &str = "no answer";
