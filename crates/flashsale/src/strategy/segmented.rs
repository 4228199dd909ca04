//! Segmented locks for a hot item: the stock is split into K segments, each a field of the
//! stock hash with its own distlock lock, so K purchases can proceed at once instead of
//! one.
//!
//! One-per-user cannot be checked per segment, since two requests of one user may land on
//! different segments. The buyers set is therefore claimed first with SADD, whose reply is
//! atomic: only one request of a user gets 1. A claim that then finds every segment empty
//! is withdrawn.

use std::collections::HashMap;

use futures_util::stream::{FuturesUnordered, StreamExt};
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

/// Takes stock from a segment: first any segment whose lock is free right now, the user's
/// own first; then, if all were busy, whichever frees first, waiting on all of them at once.
/// The whole wait is bounded by `lock_wait`, however many segments there are. `shares` is
/// the stock seen before the claim; a segment empty then is empty for good.
async fn take_from_some_segment(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
    segments: u32,
    shares: &HashMap<u32, i64>,
) -> Result<Reservation, ReserveError> {
    let give_up = tokio::time::Instant::now() + settings.lock_wait;
    let home = u32::try_from(sale.user_id.rem_euclid(i64::from(segments))).unwrap_or(0);
    let mut candidates: Vec<u32> = (0..segments)
        .map(|step| (home + step) % segments)
        .filter(|segment| shares.get(segment).is_some_and(|&left| left > 0))
        .collect();
    let segment_lock = |segment: u32| {
        locks
            .lock(sale.keys.segment_lock(segment))
            .map(|lock| lock.with_lease(settings.lock_lease))
    };
    let mut emptied = Vec::new();
    for &segment in &candidates {
        if let Some(guard) = segment_lock(segment)?.try_lock().await? {
            if sell_in(locks, sale, segment, guard).await? {
                return Ok(sale.reserved());
            }
            emptied.push(segment);
        }
    }
    candidates.retain(|segment| !emptied.contains(segment));
    while !candidates.is_empty() {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok(Reservation::Busy);
        }
        let mut waits = FuturesUnordered::new();
        for &segment in &candidates {
            let lock = segment_lock(segment)?;
            waits.push(async move { (segment, lock.try_lock_for(left).await) });
        }
        // The first lock to free wins; the other waits are dropped, which gives back
        // whatever they were about to take.
        let mut won = None;
        while let Some((segment, outcome)) = waits.next().await {
            if let Some(guard) = outcome? {
                won = Some((segment, guard));
                break;
            }
        }
        drop(waits);
        let Some((segment, guard)) = won else {
            return Ok(Reservation::Busy);
        };
        if sell_in(locks, sale, segment, guard).await? {
            return Ok(sale.reserved());
        }
        candidates.retain(|&other| other != segment);
    }
    Ok(Reservation::SoldOut)
}

/// Sells one unit from `segment` under its lock, if the segment still has stock. Returns
/// whether the sale was recorded.
async fn sell_in(
    locks: &distlock::Client,
    sale: &Sale,
    segment: u32,
    guard: distlock::LockGuard,
) -> Result<bool, ReserveError> {
    let mut conn = locks.connection();
    let outcome = match segment_stock(&mut conn, &sale.keys, segment).await {
        Ok(Some(left)) if left > 0 => sale.record(&mut conn, segment).await.map(|()| true),
        Ok(_) => Ok(false),
        Err(err) => Err(err),
    };
    guard.release().await?;
    Ok(outcome?)
}
