//! The default: one Lua script checks and writes atomically, in one round trip and with no
//! lock. Redis runs a script to completion before any other command, so no purchase can
//! see the stock between another's check and its decrement.

use distlock::Connection;

use super::{Reservation, ReserveError, Sale};
use crate::scripts::RESERVE;

pub(super) async fn reserve(
    conn: &mut Connection,
    sale: &Sale,
) -> Result<Reservation, ReserveError> {
    let code: i64 = RESERVE
        .key(&sale.keys.stock)
        .key(&sale.keys.buyers)
        .key(&sale.keys.orders)
        .arg(sale.user_id)
        .arg(&sale.order_id)
        .arg(sale.coupon_id)
        .arg(sale.at_ms)
        .invoke_async(conn)
        .await?;
    Ok(match code {
        1 => sale.reserved(),
        0 => Reservation::SoldOut,
        -1 => Reservation::AlreadyPurchased,
        -2 => Reservation::NotLoaded,
        other => {
            return Err(ReserveError::Redis(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "reserve.lua returned an unknown code",
                other.to_string(),
            ))))
        }
    })
}
