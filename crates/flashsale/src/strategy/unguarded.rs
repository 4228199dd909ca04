//! The control: read the stock, then decrement it, with nothing in between to stop other
//! purchases doing the same. Under load many requests read the last unit at once and all
//! of them sell it. It exists to show that the other strategies' guards are not for show.

use distlock::Connection;

use super::{already_purchased, Reservation, ReserveError, Sale};

pub(super) async fn reserve(
    conn: &mut Connection,
    sale: &Sale,
) -> Result<Reservation, ReserveError> {
    match sale.peek(conn, 0).await? {
        (None, _) => Ok(Reservation::NotLoaded),
        (_, Some(held)) => Ok(already_purchased(held)),
        (Some(left), _) if left <= 0 => Ok(Reservation::SoldOut),
        _ => sale.record(conn, 0, false).await,
    }
}
