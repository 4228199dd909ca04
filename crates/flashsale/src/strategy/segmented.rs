//! Segmented locks for a hot item: the stock is split into K segments, each a field of the
//! stock hash with its own distlock lock, so K purchases can proceed at once instead of
//! one.
//!
//! One-per-user cannot be checked per segment, since two requests of one user may land on
//! different segments. The buyers set is therefore claimed first with SADD, whose reply is
//! atomic: only one request of a user gets 1. A claim that then finds every segment empty
//! is withdrawn.

use super::{segment_stock, Reservation, ReserveError, Sale, StrategySettings};
use redis::AsyncCommands;

pub(super) async fn reserve(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
) -> Result<Reservation, ReserveError> {
    let mut conn = locks.connection();
    let segments = settings.stock_segments();
    // A coupon loaded with a single counter (another strategy) has no field "1"; the
    // lookup of field 0 tells "not loaded" from "loaded".
    if segment_stock(&mut conn, &sale.keys, 0).await?.is_none() {
        return Ok(Reservation::NotLoaded);
    }
    let claimed: i64 = conn.sadd(&sale.keys.buyers, sale.user_id).await?;
    if claimed == 0 {
        return Ok(Reservation::AlreadyPurchased);
    }
    let outcome = take_from_some_segment(locks, settings, sale, segments).await;
    if matches!(outcome, Ok(Reservation::SoldOut | Reservation::Busy)) {
        // Withdraw the claim, so a user who was turned away may come back. Not after an
        // error: the sale may have landed with its reply lost, and withdrawing would let
        // the user buy twice.
        let _: i64 = conn.srem(&sale.keys.buyers, sale.user_id).await?;
    }
    outcome
}

/// Starts at the user's own segment and moves on to the next while segments are empty.
async fn take_from_some_segment(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
    segments: u32,
) -> Result<Reservation, ReserveError> {
    let mut conn = locks.connection();
    let home = u32::try_from(sale.user_id.rem_euclid(i64::from(segments))).unwrap_or(0);
    let mut busy = false;
    for step in 0..segments {
        let segment = (home + step) % segments;
        // An empty segment never refills, so it is skipped without its lock.
        match segment_stock(&mut conn, &sale.keys, segment).await? {
            Some(left) if left > 0 => {}
            _ => continue,
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
