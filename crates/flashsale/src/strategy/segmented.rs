//! Segmented locks for a hot item: the stock is split into K segments, each a field of the
//! stock hash with its own distlock lock, so K purchases can proceed at once instead of
//! one.
//!
//! One-per-user cannot be checked per segment, since two requests of one user may land on
//! different segments. The buyers set is therefore claimed first with SADD, whose reply is
//! atomic: only one request of a user gets 1. A claim that then finds every segment empty
//! is withdrawn.

use std::collections::HashMap;

use redis::AsyncCommands;

use super::{segment_stock, Reservation, ReserveError, Sale, StrategySettings};

pub(super) async fn reserve(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
) -> Result<Reservation, ReserveError> {
    let mut conn = locks.connection();
    let segments = settings.stock_segments();
    // One round trip tells the common answers apart before anything is claimed or locked:
    // not loaded, already a buyer, or every segment empty (which never changes back).
    let (shares, buyer): (HashMap<u32, i64>, bool) = redis::pipe()
        .hgetall(&sale.keys.stock)
        .sismember(&sale.keys.buyers, sale.user_id)
        .query_async(&mut conn)
        .await?;
    if shares.is_empty() {
        return Ok(Reservation::NotLoaded);
    }
    if buyer {
        return Ok(Reservation::AlreadyPurchased);
    }
    if shares.values().all(|&left| left <= 0) {
        return Ok(Reservation::SoldOut);
    }
    let claimed: i64 = conn.sadd(&sale.keys.buyers, sale.user_id).await?;
    if claimed == 0 {
        return Ok(Reservation::AlreadyPurchased);
    }
    let outcome = take_from_some_segment(locks, settings, sale, segments, &shares).await;
    if matches!(outcome, Ok(Reservation::SoldOut | Reservation::Busy)) {
        // Withdraw the claim, so a user who was turned away may come back. Not after an
        // error: the sale may have landed with its reply lost, and withdrawing would let
        // the user buy twice.
        let _: i64 = conn.srem(&sale.keys.buyers, sale.user_id).await?;
    }
    outcome
}

/// Starts at the user's own segment and moves on to the next while segments are empty.
/// `shares` is the stock seen before the claim; a segment empty then is empty for good.
async fn take_from_some_segment(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
    segments: u32,
    shares: &HashMap<u32, i64>,
) -> Result<Reservation, ReserveError> {
    let mut conn = locks.connection();
    let home = u32::try_from(sale.user_id.rem_euclid(i64::from(segments))).unwrap_or(0);
    let mut busy = false;
    for step in 0..segments {
        let segment = (home + step) % segments;
        if shares.get(&segment).is_none_or(|&left| left <= 0) {
            continue;
        }
        let lock = locks
            .lock(sale.keys.segment_lock(segment))?
            .with_lease(settings.lock_lease);
        let Some(guard) = lock.try_lock_for(settings.lock_wait).await? else {
            busy = true;
            continue;
        };
        let outcome = match segment_stock(&mut conn, &sale.keys, segment).await {
            Ok(Some(left)) if left > 0 => sale.record(&mut conn, segment).await.map(|()| true),
            Ok(_) => Ok(false),
            Err(err) => Err(err),
        };
        guard.release().await?;
        if outcome? {
            return Ok(sale.reserved());
        }
    }
    Ok(if busy {
        Reservation::Busy
    } else {
        Reservation::SoldOut
    })
}
