//! Pub/sub connections, as the engine's subscription hub uses them: one to subscribe and
//! unsubscribe with ([`Sink`]), one to read events from ([`Events`]). On a standalone
//! server or a Sentinel master it is redis-rs's pub/sub connection; on a cluster, a RESP3
//! cluster connection whose pushes carry the messages, with SSUBSCRIBE on Redis 7.
//!
//! The transport carries channel names and payloads as they come; what a message means is
//! the engine's business.

use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
use redis::RedisResult;
#[cfg(feature = "cluster")]
use redis::{PushInfo, PushKind};
#[cfg(feature = "cluster")]
use tokio::sync::mpsc;

use crate::error::Result;
#[cfg(feature = "cluster")]
use crate::transport::cluster::cluster_client;
#[cfg(feature = "etcd")]
use crate::transport::etcd::{
    watch::{self as etcd_watch, EtcdEvents, EtcdSink},
    EtcdLink,
};
#[cfg(feature = "postgres")]
use crate::transport::postgres::{
    listen::{self, PgEvents, PgSink},
    PgLink,
};
use crate::transport::servers::Servers;
#[cfg(feature = "zk")]
use crate::transport::zk::{
    watch::{self as zk_watch, ZkEvents, ZkSink},
    ZkLink,
};

/// Where the hub's connection goes: a Redis deployment's pub/sub, a PostgreSQL
/// database's LISTEN/NOTIFY, etcd's or ZooKeeper's watches.
#[derive(Clone)]
pub(crate) enum FeedSource {
    Redis(Box<Servers>),
    #[cfg(feature = "postgres")]
    Postgres(PgLink),
    #[cfg(feature = "etcd")]
    Etcd(EtcdLink),
    #[cfg(feature = "zk")]
    Zk(ZkLink),
}

/// The sending half of the hub's connection.
pub(crate) enum Sink {
    Classic(PubSubSink),
    #[cfg(feature = "postgres")]
    Postgres(PgSink),
    #[cfg(feature = "etcd")]
    Etcd(EtcdSink),
    #[cfg(feature = "zk")]
    Zk(ZkSink),
    #[cfg(feature = "cluster")]
    Cluster {
        connection: ClusterConnection,
        sharded: bool,
    },
}

/// The receiving half: messages, and on a cluster the other pushes.
pub(crate) enum Events {
    Classic(PubSubStream),
    #[cfg(feature = "postgres")]
    Postgres(PgEvents),
    #[cfg(feature = "etcd")]
    Etcd(EtcdEvents),
    #[cfg(feature = "zk")]
    Zk(ZkEvents),
    #[cfg(feature = "cluster")]
    Cluster(mpsc::UnboundedReceiver<PushInfo>),
}

/// What the connection told the hub.
// Only a cluster's pushes carry the events beyond messages.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) enum Event {
    /// A message on a channel, with its payload.
    Message { channel: String, payload: Vec<u8> },
    /// The server confirmed a subscription: the first, or one redis-rs renewed after a
    /// node's connection broke or a slot moved.
    Subscribed(String),
    /// The server ended a subscription (cluster only): the hub's own unsubscribing, or a
    /// slot that moved to another master, whose sharded channels the old one drops.
    Unsubscribed(String),
    /// One node's connection broke (cluster only; redis-rs reconnects and resubscribes).
    NodeLost,
    /// Nothing the hub acts on.
    Other,
}

impl Sink {
    pub(crate) async fn subscribe(&mut self, channels: &[String]) -> Result<()> {
        self.set(channels, true).await
    }

    pub(crate) async fn unsubscribe(&mut self, channels: &[String]) -> Result<()> {
        self.set(channels, false).await
    }

    /// Subscribes to `channels` (`on`), or unsubscribes from them.
    async fn set(&mut self, channels: &[String], on: bool) -> Result<()> {
        match self {
            Sink::Classic(sink) if on => Ok(sink.subscribe(channels).await?),
            Sink::Classic(sink) => Ok(sink.unsubscribe(channels).await?),
            #[cfg(feature = "postgres")]
            Sink::Postgres(sink) => sink.set(channels, on).await,
            #[cfg(feature = "etcd")]
            Sink::Etcd(sink) => sink.set(channels, on).await,
            #[cfg(feature = "zk")]
            Sink::Zk(sink) => sink.set(channels, on).await,
            // One channel per command: the channels of one SSUBSCRIBE must share a slot.
            #[cfg(feature = "cluster")]
            Sink::Cluster {
                connection,
                sharded,
            } => {
                for channel in channels {
                    match (on, *sharded) {
                        (true, true) => connection.ssubscribe(channel).await?,
                        (true, false) => connection.subscribe(channel).await?,
                        (false, true) => connection.sunsubscribe(channel).await?,
                        (false, false) => connection.unsubscribe(channel).await?,
                    };
                }
                Ok(())
            }
        }
    }

    /// True if the connection still answers. A cluster connection watches its nodes and
    /// reconnects by itself; the hub does not second-guess it.
    pub(crate) async fn healthy(&mut self, timeout: Duration) -> bool {
        match self {
            Sink::Classic(sink) => matches!(
                tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await,
                Ok(Ok(_))
            ),
            #[cfg(feature = "cluster")]
            Sink::Cluster { .. } => true,
            #[cfg(feature = "postgres")]
            Sink::Postgres(sink) => sink.healthy(timeout).await,
            #[cfg(feature = "etcd")]
            Sink::Etcd(sink) => sink.healthy(timeout).await,
            #[cfg(feature = "zk")]
            Sink::Zk(sink) => sink.healthy(timeout).await,
        }
    }
}

impl Events {
    /// The next event; `None` when the connection is gone for good.
    pub(crate) async fn next(&mut self) -> Option<Event> {
        match self {
            Events::Classic(stream) => stream.next().await.map(|message| Event::Message {
                channel: message.get_channel_name().to_owned(),
                payload: message.get_payload_bytes().to_vec(),
            }),
            #[cfg(feature = "postgres")]
            Events::Postgres(events) => events
                .next()
                .await
                .map(|(channel, payload)| Event::Message { channel, payload }),
            #[cfg(feature = "etcd")]
            Events::Etcd(events) => events
                .next()
                .await
                .map(|(channel, payload)| Event::Message { channel, payload }),
            #[cfg(feature = "zk")]
            Events::Zk(events) => events
                .next()
                .await
                .map(|(channel, payload)| Event::Message { channel, payload }),
            #[cfg(feature = "cluster")]
            Events::Cluster(pushes) => {
                let push = pushes.recv().await?;
                let channel = || match push.data.first() {
                    Some(redis::Value::BulkString(bytes)) => {
                        Some(String::from_utf8_lossy(bytes).into_owned())
                    }
                    _ => None,
                };
                Some(match push.kind {
                    PushKind::Message | PushKind::SMessage => {
                        let payload = match push.data.get(1) {
                            Some(redis::Value::BulkString(bytes)) => bytes.clone(),
                            _ => Vec::new(),
                        };
                        channel()
                            .map_or(Event::Other, |channel| Event::Message { channel, payload })
                    }
                    PushKind::Subscribe | PushKind::SSubscribe => {
                        channel().map_or(Event::Other, Event::Subscribed)
                    }
                    PushKind::Unsubscribe | PushKind::SUnsubscribe => {
                        channel().map_or(Event::Other, Event::Unsubscribed)
                    }
                    PushKind::Disconnection => Event::NodeLost,
                    _ => Event::Other,
                })
            }
        }
    }
}

/// Opens the hub's connection to `source`.
pub(crate) async fn open(source: &FeedSource) -> Result<(Sink, Events)> {
    match source {
        FeedSource::Redis(servers) => Ok(open_redis(servers).await?),
        #[cfg(feature = "postgres")]
        FeedSource::Postgres(link) => {
            let (sink, events) = listen::open(link).await?;
            Ok((Sink::Postgres(sink), Events::Postgres(events)))
        }
        #[cfg(feature = "etcd")]
        FeedSource::Etcd(link) => {
            let (sink, events) = etcd_watch::open(link).await?;
            Ok((Sink::Etcd(sink), Events::Etcd(events)))
        }
        #[cfg(feature = "zk")]
        FeedSource::Zk(link) => {
            let (sink, events) = zk_watch::open(link).await?;
            Ok((Sink::Zk(sink), Events::Zk(events)))
        }
    }
}

async fn open_redis(source: &Servers) -> RedisResult<(Sink, Events)> {
    match source {
        Servers::Standalone(redis) => {
            let (sink, stream) = redis.get_async_pubsub().await?.split();
            Ok((Sink::Classic(sink), Events::Classic(stream)))
        }
        #[cfg(feature = "sentinel")]
        Servers::Sentinel(master) => {
            // Asked afresh at every reconnect: the hub may be the first to see a failover.
            let master = master.ask_sentinels().await?;
            let (sink, stream) = master.get_async_pubsub().await?.split();
            Ok((Sink::Classic(sink), Events::Classic(stream)))
        }
        #[cfg(feature = "cluster")]
        Servers::Cluster {
            seeds,
            sharded,
            config,
            ..
        } => {
            let (pushes, events) = mpsc::unbounded_channel();
            let client = cluster_client(seeds, config, Some(pushes))?;
            let connection = client.get_async_connection().await?;
            Ok((
                Sink::Cluster {
                    connection,
                    sharded: *sharded,
                },
                Events::Cluster(events),
            ))
        }
    }
}
