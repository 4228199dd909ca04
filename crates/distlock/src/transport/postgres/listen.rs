//! The hub's PostgreSQL connection: LISTEN and UNLISTEN on one dedicated connection, and
//! the notifications it receives, in the shape the hub takes from Redis pub/sub
//! ([`Sink`](crate::transport::pubsub::Sink), [`Events`](crate::transport::pubsub::Events)).
//!
//! A listening connection is one object that both takes commands and yields
//! notifications, so a task of its own owns it: the sink sends it commands, the events
//! come out of a channel. When the connection breaks, the task ends and the events end
//! with it; the hub then opens a new one and wakes every waiter, because a NOTIFY sent
//! meanwhile is gone (PostgreSQL keeps none for a session that is not listening).

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::Executor;
use tokio::sync::{mpsc, oneshot};

use super::PgLink;
use crate::error::{Error, Result};

/// How many channels one LISTEN or UNLISTEN query carries.
const CHANNELS_PER_QUERY: usize = 100;

/// A command for the task that owns the listening connection.
enum Command {
    /// LISTEN (`on`) or UNLISTEN each channel; answered once the server confirmed.
    Set {
        channels: Vec<String>,
        on: bool,
        done: oneshot::Sender<Result<()>>,
    },
    /// Answers whether the connection still answers a query.
    Ping(oneshot::Sender<bool>),
}

/// The sending half: LISTEN, UNLISTEN, and a health check.
pub(crate) struct PgSink {
    commands: mpsc::UnboundedSender<Command>,
    link: PgLink,
}

/// A notification, or the end of the connection (`None` from [`PgEvents::next`]).
pub(crate) struct PgEvents {
    notifications: mpsc::UnboundedReceiver<(String, Vec<u8>)>,
}

/// Opens the listening connection (on the runtime this is called on: the hub runs on the
/// client's) and starts its task. Fails if the database does not answer.
pub(crate) async fn open(link: &PgLink) -> Result<(PgSink, PgEvents)> {
    let classify = |err| super::classify(link.target(), err);
    // A pool of its own, of one connection: the listening connection is never one the
    // lock calls wait for.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(link.options().clone());
    let mut listener = PgListener::connect_with(&pool).await.map_err(classify)?;
    // Notifications sent while the connection was down are gone either way; the hub
    // wakes everyone after opening a new one. So no quiet reconnect inside the driver.
    listener.eager_reconnect(false);
    sqlx::query("SELECT 1")
        .execute(&mut listener)
        .await
        .map_err(classify)?;
    let (commands, received) = mpsc::unbounded_channel();
    let (notify, notifications) = mpsc::unbounded_channel();
    tokio::spawn(drive(listener, received, notify));
    Ok((
        PgSink {
            commands,
            link: link.clone(),
        },
        PgEvents { notifications },
    ))
}

/// Owns the listening connection until it breaks or the hub lets go of it.
async fn drive(
    mut listener: PgListener,
    mut commands: mpsc::UnboundedReceiver<Command>,
    notify: mpsc::UnboundedSender<(String, Vec<u8>)>,
) {
    loop {
        tokio::select! {
            // Commands first: a LISTEN the hub waits on is never held up by a stream of
            // notifications. Waiting for a notification is cancel-safe in the driver (it
            // keeps a partly read message in its buffer).
            biased;
            command = commands.recv() => match command {
                None => return,
                Some(Command::Set { channels, on, done }) => {
                    // Many channels in one query (a round trip per channel would not
                    // keep up with many waiters behind a slow link).
                    let mut outcome = Ok(());
                    for chunk in channels.chunks(CHANNELS_PER_QUERY) {
                        let verb = if on { "LISTEN" } else { "UNLISTEN" };
                        let batch: String = chunk
                            .iter()
                            .map(|channel| format!("{verb} \"{}\";", channel.replace('"', "\"\"")))
                            .collect();
                        if let Err(err) = (&mut listener).execute(batch.as_str()).await {
                            outcome = Err(err);
                            break;
                        }
                    }
                    let failed = outcome.is_err();
                    let _ = done.send(outcome.map_err(|err| super::classify("", err)));
                    if failed {
                        return;
                    }
                }
                Some(Command::Ping(done)) => {
                    let alive = sqlx::query("SELECT 1").execute(&mut listener).await.is_ok();
                    let _ = done.send(alive);
                    if !alive {
                        return;
                    }
                }
            },
            received = listener.try_recv() => match received {
                Ok(Some(notification)) => {
                    let message = (
                        notification.channel().to_owned(),
                        notification.payload().as_bytes().to_vec(),
                    );
                    if notify.send(message).is_err() {
                        return;
                    }
                }
                // The connection broke (`None`), or failed: the hub opens another.
                Ok(None) | Err(_) => return,
            },
        }
    }
}

impl PgSink {
    /// LISTENs (`on`) or UNLISTENs `channels`, once the server confirmed.
    pub(crate) async fn set(&mut self, channels: &[String], on: bool) -> Result<()> {
        let (done, answer) = oneshot::channel();
        let command = Command::Set {
            channels: channels.to_vec(),
            on,
            done,
        };
        if self.commands.send(command).is_err() {
            return Err(self.gone());
        }
        match answer.await {
            Ok(outcome) => outcome.map_err(|err| match err {
                // Named here: the driver's task does not know the target.
                Error::Store {
                    store,
                    failure,
                    detail,
                    ..
                } => Error::Store {
                    store,
                    target: self.link.target().to_owned(),
                    failure,
                    detail,
                },
                other => other,
            }),
            Err(_) => Err(self.gone()),
        }
    }

    /// True if the listening connection answers a query within `timeout`.
    pub(crate) async fn healthy(&mut self, timeout: Duration) -> bool {
        let (done, answer) = oneshot::channel();
        if self.commands.send(Command::Ping(done)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(timeout, answer).await, Ok(Ok(true)))
    }

    fn gone(&self) -> Error {
        Error::Store {
            store: super::STORE,
            target: self.link.target().to_owned(),
            failure: crate::error::StoreFailure::Connection,
            detail: "the listening connection closed".into(),
        }
    }
}

impl PgEvents {
    /// The next notification as `(channel, payload)`; `None` once the connection is gone.
    pub(crate) async fn next(&mut self) -> Option<(String, Vec<u8>)> {
        self.notifications.recv().await
    }
}
