//! What a coupon's Redis holds of its orders, against what SQL stored.
//!
//! Redis holds the order every buyer was told about (the buyers hash) and one order event
//! per sale of the script strategies (the stream). An event is **queued** while a worker
//! may still store it: not yet delivered to the workers' consumer group, or delivered and
//! not yet acknowledged. A worker acknowledges an event only after its order committed,
//! so an acknowledged order that SQL does not hold was lost by SQL (a database restored
//! from a backup, writes lost), and nothing stores it again unless something looks:
//! `serve` does at start (`stock::StockLoader`), `reconcile` reports it, and the order
//! lookup says `lost`.

use std::collections::{HashMap, HashSet};

use redis::streams::{StreamPendingCountReply, StreamRangeReply};
use redis::AsyncCommands;
use serde::Serialize;

use crate::db::{Db, DbError};
use crate::keys::{CouponKeys, ORDER_GROUP};

/// Stream entries read per XRANGE page, and pending entries per XPENDING page.
const PAGE: usize = 1000;
/// The most queued entries one order lookup reads to find its event, of each kind
/// (undelivered, pending): a lookup stays cheap behind a long backlog.
const LOOKUP_SCAN: usize = 2_000;

/// Why reading a coupon's orders failed.
#[derive(Debug, thiserror::Error)]
pub enum OrderEventsError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The database failed.
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Where a coupon's order stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Events in the stream: every sale Redis counted.
    pub length: i64,
    /// Events not yet delivered to a worker.
    pub lag: i64,
    /// Events delivered but not yet acknowledged.
    pub pending: i64,
}

/// Creates the order workers' consumer group, and the stream with it, if missing. Reading
/// from id 0 means a group recreated after Redis lost its data still sees every entry.
pub async fn ensure_group<C>(conn: &mut C, keys: &CouponKeys) -> redis::RedisResult<()>
where
    C: redis::aio::ConnectionLike + Send + Sync,
{
    let created: redis::RedisResult<()> = conn
        .xgroup_create_mkstream(&keys.orders, ORDER_GROUP, "0")
        .await;
    match created {
        Err(err) if err.code() == Some("BUSYGROUP") => Ok(()),
        other => other,
    }
}

/// The coupon stream's length and backlog.
pub async fn stream_backlog(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<Backlog> {
    let length: i64 = conn.xlen(&keys.orders).await?;
    let Some(group) = workers_group(conn, keys).await? else {
        return Ok(groups_missing(length));
    };
    let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    // Redis reports no lag when it cannot tell; counting the whole stream as undelivered
    // errs on the side of "not drained".
    let lag = group
        .lag
        .map(as_i64)
        .or(group.entries_read.map(|read| length - as_i64(read)))
        .unwrap_or(length);
    Ok(Backlog {
        length,
        lag,
        pending: as_i64(group.pending),
    })
}

/// The workers' consumer group on the coupon's stream; `None` when there is no stream or
/// no group yet (every entry is then undelivered).
async fn workers_group(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<Option<redis::streams::StreamInfoGroup>> {
    let groups: redis::RedisResult<redis::streams::StreamInfoGroupsReply> =
        conn.xinfo_groups(&keys.orders).await;
    match groups {
        Ok(groups) => Ok(groups
            .groups
            .into_iter()
            .find(|group| group.name == ORDER_GROUP)),
        // No such stream.
        Err(err)
            if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) =>
        {
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// No group reads the stream yet, so every event in it is undelivered.
fn groups_missing(length: i64) -> Backlog {
    Backlog {
        length,
        lag: length,
        pending: 0,
    }
}

/// A stream entry id, ordered as Redis orders them: milliseconds, then sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct EntryId(u64, u64);

impl EntryId {
    fn parse(id: &str) -> EntryId {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        EntryId(ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
    }
}

/// Where the workers' consumer group stands on a stream.
struct GroupPosition {
    /// Entries after this one were never delivered.
    last_delivered: EntryId,
    /// Entries delivered and not acknowledged.
    pending: usize,
    /// Entries not yet delivered (`None` when Redis cannot tell).
    lag: Option<usize>,
}

/// The group's position, or `None` when there is no stream or no group yet.
async fn group_position(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<Option<GroupPosition>> {
    Ok(workers_group(conn, keys).await?.map(|group| GroupPosition {
        last_delivered: EntryId::parse(&group.last_delivered_id),
        pending: group.pending,
        lag: group.lag,
    }))
}

/// The ids of up to `limit` entries delivered and not acknowledged (all of them when
/// `limit` is `None`), and whether that was all of them.
async fn pending_ids(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
    limit: Option<usize>,
) -> redis::RedisResult<(HashSet<String>, bool)> {
    let mut ids = HashSet::new();
    let mut start = "-".to_owned();
    loop {
        let page: StreamPendingCountReply = conn
            .xpending_count(&keys.orders, ORDER_GROUP, &start, "+", PAGE)
            .await?;
        let Some(last) = page.ids.last().map(|pending| pending.id.clone()) else {
            return Ok((ids, true));
        };
        let full = page.ids.len() == PAGE;
        ids.extend(page.ids.into_iter().map(|pending| pending.id));
        if !full {
            return Ok((ids, true));
        }
        if limit.is_some_and(|limit| ids.len() >= limit) {
            return Ok((ids, false));
        }
        start = format!("({last}");
    }
}

/// One order event of a coupon's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEvent {
    /// The order it carries.
    pub order_id: String,
    /// The buyer.
    pub user_id: i64,
    /// When the buyer was told (the sale's time, Unix ms), if the event says.
    pub told_at_ms: Option<i64>,
    /// Whether a worker may still store it: undelivered, or delivered and not acknowledged.
    pub queued: bool,
}

/// Every order event of the coupon's stream, read in pages, each marked queued or not.
/// The group's position is read first, so an event acknowledged during the walk counts as
/// queued: never as stored when it was not.
pub async fn stream_events(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<Vec<StreamEvent>> {
    let position = group_position(conn, keys).await?;
    let pending = match &position {
        Some(position) if position.pending > 0 => pending_ids(conn, keys, None).await?.0,
        _ => HashSet::new(),
    };
    walk(conn, &keys.orders, |id| match &position {
        None => true,
        Some(position) => EntryId::parse(id) > position.last_delivered || pending.contains(id),
    })
    .await
}

/// Every order event of stream `stream`, read in pages, marked queued as `queued` says of
/// its entry id.
async fn walk(
    conn: &mut distlock::Connection,
    stream: &str,
    queued: impl Fn(&str) -> bool,
) -> redis::RedisResult<Vec<StreamEvent>> {
    let mut events = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let page: StreamRangeReply = conn.xrange_count(stream, &start, "+", PAGE).await?;
        let Some(last) = page.ids.last() else { break };
        // An exclusive start ("(id") skips the entry the previous page ended on.
        start = format!("({}", last.id);
        let full = page.ids.len() == PAGE;
        events.extend(page.ids.iter().filter_map(|entry| {
            Some(StreamEvent {
                order_id: entry.get("order")?,
                user_id: entry.get("user")?,
                told_at_ms: entry.get("at"),
                queued: queued(&entry.id),
            })
        }));
        if !full {
            break;
        }
    }
    Ok(events)
}

/// Whether one order's event may still be stored by a worker ([`event_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventState {
    /// It waits for a worker; told at this time (Unix ms) when the event was found.
    Queued {
        /// When the buyer was told, if known.
        told_at_ms: Option<i64>,
    },
    /// No worker will store it: its event was acknowledged (its order committed), or
    /// there is none.
    NotQueued,
}

/// Whether order `order_id`'s event still waits for a worker, reading at most a few
/// thousand queued entries: behind a longer backlog, an event not found among them is
/// taken for queued, with no time.
pub async fn event_state(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
    order_id: &str,
) -> redis::RedisResult<EventState> {
    let position = group_position(conn, keys).await?;
    let (undelivered_from, pending) = match &position {
        None => ("-".to_owned(), 0),
        Some(position) if position.lag == Some(0) && position.pending == 0 => {
            return Ok(EventState::NotQueued)
        }
        Some(position) => (
            format!(
                "({}-{}",
                position.last_delivered.0, position.last_delivered.1
            ),
            position.pending,
        ),
    };
    let found = |entries: &StreamRangeReply| {
        entries.ids.iter().find_map(|entry| {
            (entry.get::<String>("order").as_deref() == Some(order_id)).then(|| {
                EventState::Queued {
                    told_at_ms: entry.get("at"),
                }
            })
        })
    };
    let undelivered: StreamRangeReply = conn
        .xrange_count(&keys.orders, &undelivered_from, "+", LOOKUP_SCAN)
        .await?;
    if let Some(state) = found(&undelivered) {
        return Ok(state);
    }
    let mut complete = undelivered.ids.len() < LOOKUP_SCAN;
    if pending > 0 {
        let (ids, all) = pending_ids(conn, keys, Some(LOOKUP_SCAN)).await?;
        complete &= all;
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.xrange(&keys.orders, id, id);
        }
        let entries: Vec<StreamRangeReply> = pipe.query_async(conn).await?;
        if let Some(state) = entries.iter().find_map(found) {
            return Ok(state);
        }
    }
    Ok(if complete {
        EventState::NotQueued
    } else {
        EventState::Queued { told_at_ms: None }
    })
}

/// The buyers Redis holds an order for (claims of segmented sales in progress left out):
/// user to order id, read in pages.
pub async fn held_orders(
    conn: &mut distlock::Connection,
    keys: &CouponKeys,
) -> redis::RedisResult<HashMap<i64, String>> {
    let mut orders = HashMap::new();
    let mut cursor = 0_u64;
    loop {
        let (next, page): (u64, Vec<(i64, String)>) = redis::cmd("HSCAN")
            .arg(&keys.buyers)
            .arg(cursor)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await?;
        orders.extend(
            page.into_iter()
                .filter(|(_, entry)| !entry.starts_with('~')),
        );
        if next == 0 {
            return Ok(orders);
        }
        cursor = next;
    }
}

/// An order Redis holds (its buyer was told 201) that SQL does not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unstored {
    /// The order id the buyer was given.
    pub order_id: String,
    /// The buyer.
    pub user_id: i64,
    /// The coupon.
    pub coupon_id: i64,
    /// When the buyer was told (RFC 3339), when the order's event says.
    pub told_at: Option<String>,
    /// Unix ms of `told_at`.
    #[serde(skip)]
    pub told_at_ms: Option<i64>,
    /// Whether its event still waits for a worker (then it is on its way to SQL, unless
    /// this Redis is no longer the store's authority).
    pub queued: bool,
}

impl Unstored {
    fn new(
        order_id: String,
        user_id: i64,
        coupon_id: i64,
        told_at_ms: Option<i64>,
        queued: bool,
    ) -> Unstored {
        Unstored {
            told_at: told_at_ms.map(crate::model::format_millis),
            told_at_ms,
            queued,
            order_id,
            user_id,
            coupon_id,
        }
    }
}

/// `orders` by when their buyers were told, then by id.
fn oldest_first(mut orders: Vec<Unstored>) -> Vec<Unstored> {
    orders.sort_by(|a, b| (a.told_at_ms, &a.order_id).cmp(&(b.told_at_ms, &b.order_id)));
    orders
}

/// The orders coupon `coupon_id`'s Redis holds whose ids SQL does not hold: each buyer
/// was told 201 for it. SQL is read first: an order reaches Redis before SQL, so none
/// stored in between looks missing, and each candidate is looked up once more.
pub async fn unstored_orders(
    db: &Db,
    conn: &mut distlock::Connection,
    coupon_id: i64,
) -> Result<Vec<Unstored>, OrderEventsError> {
    let keys = db.keyspace().coupon(coupon_id);
    let stored = stored_orders(db, coupon_id).await?;
    let held = held_orders(conn, &keys).await?;
    if held.values().all(|order| stored.contains(order)) {
        return Ok(Vec::new());
    }
    let events: HashMap<String, StreamEvent> = stream_events(conn, &keys)
        .await?
        .into_iter()
        .map(|event| (event.order_id.clone(), event))
        .collect();
    let mut unstored = Vec::new();
    for (user, order) in held {
        if stored.contains(&order) || db.order(&order).await?.is_some() {
            continue;
        }
        let event = events.get(&order);
        unstored.push(Unstored::new(
            order,
            user,
            coupon_id,
            event.and_then(|event| event.told_at_ms),
            event.is_some_and(|event| event.queued),
        ));
    }
    Ok(oldest_first(unstored))
}

/// The orders of coupon `coupon_id` that Redis holds, a worker already stored (their
/// events acknowledged) or none was to (no event), and SQL lacks: the database lost them
/// (restored from a backup taken mid-sale), and nothing stores them again unless asked.
/// When Redis holds no more buyers than SQL holds orders and events are queued, none can
/// be missing, and nothing more is read.
pub async fn lost_by_sql(
    db: &Db,
    conn: &mut distlock::Connection,
    coupon_id: i64,
) -> Result<Vec<Unstored>, OrderEventsError> {
    let keys = db.keyspace().coupon(coupon_id);
    let sql_orders = db.order_count(coupon_id).await?;
    let (entries, claims): (i64, i64) = redis::pipe()
        .atomic()
        .hlen(&keys.buyers)
        .zcard(&keys.claims)
        .query_async(conn)
        .await?;
    let backlog = stream_backlog(conn, &keys).await?;
    if entries - claims <= sql_orders + backlog.lag + backlog.pending {
        return Ok(Vec::new());
    }
    // A buyer SQL holds another order for has a unit already (`reconcile` reports the
    // difference): storing this one would be refused, and must not hold a release up.
    let buyers: HashSet<i64> = db
        .buyers(coupon_id)
        .await?
        .into_iter()
        .map(|(user, _)| user)
        .collect();
    let mut lost = unstored_orders(db, conn, coupon_id).await?;
    lost.retain(|order| !order.queued && !buyers.contains(&order.user_id));
    Ok(lost)
}

/// The ids of the orders the store knows for coupon `coupon_id`: those it holds, and those
/// it refused as beyond the stock (listed by `reconcile` on their own).
async fn stored_orders(db: &Db, coupon_id: i64) -> Result<HashSet<String>, DbError> {
    let mut known: HashSet<String> = db
        .buyers(coupon_id)
        .await?
        .into_iter()
        .map(|(_, order)| order)
        .collect();
    known.extend(
        db.refused_orders(coupon_id)
            .await?
            .into_iter()
            .map(|order| order.order_id),
    );
    Ok(known)
}

/// The orders of coupon `coupon_id` the store refused as beyond its stock: their buyers
/// were told 201 by a Redis that counted units already sold.
pub async fn refused_over_stock(db: &Db, coupon_id: i64) -> Result<Vec<Unstored>, DbError> {
    Ok(db
        .refused_orders(coupon_id)
        .await?
        .into_iter()
        .map(|order| {
            Unstored::new(
                order.order_id,
                order.user_id,
                coupon_id,
                Some(order.created_at),
                false,
            )
        })
        .collect())
}

/// The orders coupon `coupon_id`'s retired streams hold (`stock::retire_stream`: set aside
/// when an earlier tenure of this Redis ended, or when an earlier coupon had the same id)
/// whose ids SQL does not hold: told 201, and never to be stored (a buyer who bought
/// again since holds another order, and is listed all the same: they were told twice).
pub async fn retired_unstored(
    db: &Db,
    conn: &mut distlock::Connection,
    coupon_id: i64,
) -> Result<Vec<Unstored>, OrderEventsError> {
    let keys = db.keyspace().coupon(coupon_id);
    let streams: Vec<String> = conn.smembers(&keys.retired).await?;
    if streams.is_empty() {
        return Ok(Vec::new());
    }
    let stored = stored_orders(db, coupon_id).await?;
    let mut seen = HashSet::new();
    let mut unstored = Vec::new();
    for stream in streams {
        for event in walk(conn, &stream, |_| false).await? {
            if stored.contains(&event.order_id) || !seen.insert(event.order_id.clone()) {
                continue;
            }
            if db.order(&event.order_id).await?.is_some() {
                continue;
            }
            unstored.push(Unstored::new(
                event.order_id,
                event.user_id,
                coupon_id,
                event.told_at_ms,
                false,
            ));
        }
    }
    Ok(oldest_first(unstored))
}

#[cfg(test)]
mod tests {
    use super::EntryId;

    #[test]
    fn entry_ids_order_by_milliseconds_then_sequence() {
        assert!(EntryId::parse("1700000000000-1") > EntryId::parse("1700000000000-0"));
        assert!(EntryId::parse("1700000000001-0") > EntryId::parse("1700000000000-9"));
        assert!(EntryId::parse("10-0") > EntryId::parse("9-99"));
        assert_eq!(EntryId::parse("0-0"), EntryId::default());
    }
}
