//! A per-coupon distlock lock around plain commands: the textbook "lock, check, write,
//! unlock". Correct while the lease holds, and it costs five round trips per sale (four of
//! them under the lock, serialized with every other sale) where the script costs one.

use super::{Reservation, ReserveError, Sale, StrategySettings};

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
        (_, true) => return Ok(Reservation::AlreadyPurchased),
        (Some(left), _) if left <= 0 => return Ok(Reservation::SoldOut),
        _ => {}
    }
    let lock = locks
        .lock(sale.keys.lock())?
        .with_lease(settings.lock_lease);
    let Some(guard) = lock.try_lock_for(settings.lock_wait).await? else {
        return Ok(Reservation::Busy);
    };
    let outcome = match sale.peek(&mut conn, 0).await {
        Ok((None, _)) => Ok(Reservation::NotLoaded),
        Ok((_, true)) => Ok(Reservation::AlreadyPurchased),
        Ok((Some(left), _)) if left <= 0 => Ok(Reservation::SoldOut),
        Ok(_) => sale.record(&mut conn, 0).await.map(|()| sale.reserved()),
        Err(err) => Err(err),
    };
    guard.release().await?;
    Ok(outcome?)
}
