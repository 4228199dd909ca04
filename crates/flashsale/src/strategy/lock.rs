//! The seeds' design, made correct: a Redisson-style `tryLock(wait, lease)` on the coupon's
//! lock; under it, a check of stock and buyer in Redis, then the order written to SQL.
//!
//! The lock alone cannot make the write safe: a holder paused past its lease (GC, swap,
//! SIGSTOP) wakes up believing it still holds the lock while another instance does. So the
//! SQL transaction decides for itself ([`Db::sell_fenced`]):
//!
//! - it raises the coupon's fence to the lock's fencing token, and refuses the sale if a
//!   larger token has written: a late holder cannot write once a newer one has;
//! - it counts the stock and looks for the buyer's order in SQL, not in what Redis said
//!   before, so a sale decided on a stale read cannot oversell;
//! - it asks the guard whether the lease is still trusted just before the commit.
//!
//! Redis is then told what SQL decided (the units left and the buyer's order), so that
//! the losers of a sale are answered from Redis without the lock. SQL is the truth: a
//! failed or late Redis update is corrected by the next sale of the coupon.
//!
//! [`Db::sell_fenced`]: crate::db::Db::sell_fenced

use tokio::time::Instant;

use super::{already_purchased, Reservation, ReserveError, Reserver, Sale};
use crate::db::{FencedCommitError, FencedSale};
use crate::model::now_millis;

pub(super) async fn reserve(reserver: &Reserver, sale: &Sale) -> Result<Reservation, ReserveError> {
    let settings = &reserver.settings;
    let mut conn = reserver.locks.connection();
    // Outside the lock, only answers that cannot change back are trusted: a sold-out coupon
    // stays sold out and a buyer stays a buyer. This keeps the losers of a sale off the lock.
    if let Some(decided) = settled_in_redis(&mut conn, sale).await? {
        return Ok(decided);
    }
    let lock = reserver
        .locks
        .lock(sale.keys.lock())?
        .with_lease(settings.lock_lease);
    let wait = settings
        .lock_wait
        .min(sale.deadline.saturating_duration_since(Instant::now()));
    let waiting = Instant::now();
    let acquired = lock.try_lock_for(wait).await;
    reserver
        .metrics
        .lock_wait_seconds
        .observe(waiting.elapsed().as_secs_f64());
    let Some(guard) = acquired? else {
        return Ok(Reservation::Busy);
    };
    let outcome = sell_under(reserver, &mut conn, sale, &lock, &guard).await;
    // The outcome is decided; a release that fails (the lease ran out, Redis hiccuped)
    // does not change it, and the lease frees the lock anyway.
    if let Err(err) = guard.release().await {
        tracing::warn!(error = %err, "releasing a coupon lock failed after the sale was decided");
    }
    outcome
}

/// The answers Redis can give for good: not loaded, already a buyer, sold out. `None`
/// when a unit may be left.
///
/// Sold out can be trusted because Redis hears it only from [`mirror_sold_out`], which
/// gives Redis every buyer SQL holds first.
async fn settled_in_redis(
    conn: &mut distlock::Connection,
    sale: &Sale,
) -> Result<Option<Reservation>, ReserveError> {
    Ok(match sale.peek(conn, 0).await? {
        (None, _) => Some(Reservation::NotLoaded),
        (_, Some(held)) => Some(already_purchased(held)),
        (Some(left), _) if left <= 0 => Some(Reservation::SoldOut),
        _ => None,
    })
}

/// Tells Redis that SQL sold the last unit: every buyer SQL holds, then 0 units left.
///
/// A sale is committed in SQL before Redis hears of it, so a Redis that lost that update
/// (killed in between) does not know the buyer, and later sales correct its counter but
/// not its buyers. Once the counter said 0, that buyer's retry would be told `sold_out`
/// from Redis though they hold an order (a review saw it in 3 of 4 runs with the private
/// Redis killed mid-burst). Writing every buyer before the 0 makes a sold-out counter
/// imply a complete buyers hash; if this is cut short, the counter stays above 0, and the
/// next purchase comes here again through the lock. One read of the coupon's orders, once
/// per sell-out, instead of an SQL read for each of the many sold-out answers.
async fn mirror_sold_out(reserver: &Reserver, conn: &mut distlock::Connection, sale: &Sale) {
    let buyers = match reserver.db.buyers(sale.coupon_id).await {
        Ok(buyers) => buyers,
        Err(err) => {
            tracing::warn!(coupon = sale.coupon_id, error = %err, "could not read the buyers to mark a sold-out coupon in Redis; the next purchase tries again");
            return;
        }
    };
    if let Err(err) = crate::stock::put_buyers(conn, &sale.keys, &buyers).await {
        tracing::warn!(coupon = sale.coupon_id, error = %err, "could not write the buyers of a sold-out coupon to Redis; the next purchase tries again");
        return;
    }
    sale.mirror_sql(conn, Some(0), None).await;
}

/// The critical section: check in Redis, write to SQL under the fence, tell Redis.
async fn sell_under(
    reserver: &Reserver,
    conn: &mut distlock::Connection,
    sale: &Sale,
    lock: &distlock::Lock,
    guard: &distlock::LockGuard,
) -> Result<Reservation, ReserveError> {
    if let Some(decided) = settled_in_redis(conn, sale).await? {
        return Ok(decided);
    }
    if Instant::now() >= sale.deadline {
        return Ok(Reservation::Expired);
    }
    reserver.settings.fault_point(sale);
    let sold = reserver
        .db
        .sell_fenced(
            sale.tenure.admission(),
            &sale.event(),
            guard.fencing_token(),
            now_millis(),
            || !guard.is_lost(),
        )
        .await;
    let refused = |reason: &str| {
        reserver.metrics.count_lock_write_refused(reason);
        tracing::warn!(order = %sale.order_id, token = guard.fencing_token(), reason, "a coupon lock's write was refused");
        Ok(Reservation::LockLost)
    };
    match sold {
        Ok(FencedSale::Sold { remaining }) => {
            reserver.metrics.orders_stored.inc();
            if remaining > 0 {
                sale.mirror_sql(conn, Some(remaining), Some(&sale.order_id))
                    .await;
            } else {
                mirror_sold_out(reserver, conn, sale).await;
            }
            Ok(sale.reserved())
        }
        Ok(FencedSale::SoldOut) => {
            mirror_sold_out(reserver, conn, sale).await;
            Ok(Reservation::SoldOut)
        }
        Ok(FencedSale::AlreadyBought { order_id }) => {
            sale.mirror_sql(conn, None, Some(&order_id)).await;
            Ok(Reservation::AlreadyPurchased {
                order_id: Some(order_id),
            })
        }
        Ok(FencedSale::Fenced { highest }) => {
            // A stale holder finds the counter past `highest` already. A counter that went
            // back (Redis lost it) is put past it, so the next holder is not refused too.
            if let Err(err) = lock.advance_fencing_counter(highest).await {
                tracing::warn!(error = %err, "could not advance the coupon lock's fencing counter");
            }
            refused("fenced")
        }
        Ok(FencedSale::LeaseLost) => refused("lease_lost"),
        Ok(FencedSale::NoCoupon) => Ok(Reservation::NotLoaded),
        Ok(FencedSale::Evicted) => {
            sale.tenure.evict();
            Err(ReserveError::NotAuthority)
        }
        Err(FencedCommitError::Before(err)) => Err(err.into()),
        Err(FencedCommitError::InDoubt(source)) => Err(ReserveError::CommitInDoubt { source }),
    }
}

/// Critical sections the start-up probe times.
const PROBE_ROUNDS: usize = 32;

/// Times the critical section's round trips as the service starts: a Redis check like the
/// one under the lock, and a committed SQL write (with its fsync), `PROBE_ROUNDS` times.
/// Returns the p99. It runs before any traffic, so the figure is a floor: under load the
/// section takes longer, which is why the lease must exceed it several times over
/// ([`super::LEASE_HEADROOM`]).
pub(super) async fn critical_section_p99(
    locks: &distlock::Client,
    db: &crate::db::Db,
) -> Result<std::time::Duration, ReserveError> {
    let probe_keys = db.keyspace().coupon(0);
    let mut conn = locks.connection();
    let mut took = Vec::with_capacity(PROBE_ROUNDS);
    for _ in 0..PROBE_ROUNDS {
        let started = Instant::now();
        super::peek(&mut conn, &probe_keys, 0, 0).await?;
        db.check_writable(now_millis()).await?;
        took.push(started.elapsed());
    }
    took.sort();
    let rank = (took.len() * 99).div_ceil(100).saturating_sub(1);
    Ok(took[rank])
}
