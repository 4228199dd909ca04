//! A per-coupon distlock lock around plain commands: the textbook "lock, check, write,
//! unlock". Correct while the lease holds, and it costs five round trips per sale (four of
//! them under the lock, serialized with every other sale) where the script costs one.

use tokio::time::Instant;

use super::{already_purchased, Reservation, ReserveError, Sale, StrategySettings};

pub(super) async fn reserve(
    locks: &distlock::Client,
    settings: &StrategySettings,
    sale: &Sale,
) -> Result<Reservation, ReserveError> {
    let mut conn = locks.connection();
    // Outside the lock, only answers that cannot change back are trusted: a sold-out coupon
    // stays sold out and a buyer stays a buyer. This keeps the losers of a sale off the lock.
    match sale.peek(&mut conn, 0).await? {
        (None, _) => return Ok(Reservation::NotLoaded),
        (_, Some(held)) => return Ok(already_purchased(held)),
        (Some(left), _) if left <= 0 => return Ok(Reservation::SoldOut),
        _ => {}
    }
    let lock = locks
        .lock(sale.keys.lock())?
        .with_lease(settings.lock_lease);
    let wait = settings
        .lock_wait
        .min(sale.deadline.saturating_duration_since(Instant::now()));
    let Some(guard) = lock.try_lock_for(wait).await? else {
        return Ok(Reservation::Busy);
    };
    let outcome = match sale.peek(&mut conn, 0).await {
        Ok((None, _)) => Ok(Reservation::NotLoaded),
        Ok((_, Some(held))) => Ok(already_purchased(held)),
        Ok((Some(left), _)) if left <= 0 => Ok(Reservation::SoldOut),
        Ok(_) => sale.record(&mut conn, 0).await,
        Err(err) => Err(err.into()),
    };
    // The outcome is decided; a release that fails (the lease ran out, Redis hiccuped)
    // does not change it, and the lease frees the lock anyway.
    if let Err(err) = guard.release().await {
        tracing::warn!(error = %err, "releasing a coupon lock failed after the sale was decided");
    }
    outcome
}
