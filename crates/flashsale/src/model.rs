//! Coupons and orders, as the API and the database see them.

use serde::{Deserialize, Serialize, Serializer};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// The most stock one coupon may have. Far above any real flash sale, and low enough that
/// the buyers set and the order stream of a sold-out coupon stay a few hundred MB at most.
pub const MAX_STOCK: i64 = 10_000_000;
/// The longest title accepted, in characters.
pub const MAX_TITLE_CHARS: usize = 200;

/// The body of `POST /api/coupons`.
#[derive(Debug, Clone, Deserialize)]
pub struct NewCoupon {
    /// Shown to buyers; 1 to 200 characters.
    pub title: String,
    /// Units for sale, 1 to [`MAX_STOCK`].
    pub stock: i64,
    /// In the currency's minor unit (cents), so no rounding ever touches money.
    pub price: i64,
    /// RFC 3339, e.g. `2026-11-11T00:00:00+08:00`.
    #[serde(with = "time::serde::rfc3339")]
    pub starts_at: OffsetDateTime,
    /// RFC 3339; must be after `starts_at`.
    #[serde(with = "time::serde::rfc3339")]
    pub ends_at: OffsetDateTime,
}

/// A field of a [`NewCoupon`] that is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct FieldError {
    /// The JSON field at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl NewCoupon {
    /// Checks every field, returning the first that is out of range.
    pub fn validate(&self) -> Result<(), FieldError> {
        let fail = |field, reason: String| Err(FieldError { field, reason });
        let title_chars = self.title.trim().chars().count();
        if title_chars == 0 {
            return fail("title", "must not be empty".into());
        }
        if title_chars > MAX_TITLE_CHARS {
            return fail(
                "title",
                format!("must be at most {MAX_TITLE_CHARS} characters"),
            );
        }
        if !(1..=MAX_STOCK).contains(&self.stock) {
            return fail("stock", format!("must be between 1 and {MAX_STOCK}"));
        }
        if self.price < 0 {
            return fail("price", "must not be negative (it is in cents)".into());
        }
        if self.ends_at <= self.starts_at {
            return fail("ends_at", "must be after starts_at".into());
        }
        Ok(())
    }
}

/// A coupon as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Coupon {
    /// Assigned by the database.
    pub id: i64,
    /// Shown to buyers.
    pub title: String,
    /// Units for sale when the sale opened.
    pub stock: i64,
    /// In cents.
    pub price: i64,
    /// When purchases open.
    #[serde(serialize_with = "rfc3339_millis")]
    pub starts_at: i64,
    /// When purchases close.
    #[serde(serialize_with = "rfc3339_millis")]
    pub ends_at: i64,
    /// When the row was created, Unix ms: with the id, what tells this coupon from another
    /// that had its id before the database was restored.
    #[serde(skip)]
    pub created_at: i64,
}

/// Where a coupon's sale stands at some instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaleWindow {
    /// Before `starts_at`.
    NotStarted,
    /// Purchases are accepted.
    Open,
    /// At or after `ends_at`.
    Ended,
}

impl Coupon {
    /// Where the sale stands at `now_ms`.
    pub fn window_at(&self, now_ms: i64) -> SaleWindow {
        if now_ms < self.starts_at {
            SaleWindow::NotStarted
        } else if now_ms >= self.ends_at {
            SaleWindow::Ended
        } else {
            SaleWindow::Open
        }
    }
}

/// One sale, as the reservation appends it to the coupon's stream and the worker stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderEvent {
    /// A UUID chosen at reservation.
    pub order_id: String,
    /// The coupon bought.
    pub coupon_id: i64,
    /// The buyer.
    pub user_id: i64,
    /// When it was reserved, Unix milliseconds.
    pub created_at: i64,
}

/// A stored order, as `GET /api/users/{id}/orders` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Order {
    /// The id returned by the purchase.
    pub order_id: String,
    /// The coupon bought.
    pub coupon_id: i64,
    /// The buyer.
    pub user_id: i64,
    /// When the purchase was reserved.
    #[serde(serialize_with = "rfc3339_millis")]
    pub created_at: i64,
    /// When the worker wrote it to the database.
    #[serde(serialize_with = "rfc3339_millis")]
    pub stored_at: i64,
}

/// Unix milliseconds of `at`, saturating far outside any real date.
pub fn unix_millis(at: OffsetDateTime) -> i64 {
    i64::try_from(at.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// A new order id for `user_id`'s purchase of `coupon_id`: `c{COUPON}-u{USER}-{RANDOM}`.
/// It names its coupon and buyer, so an order still queued in Redis can be looked up by
/// its id before the worker stored it.
pub fn new_order_id(coupon_id: i64, user_id: i64) -> String {
    format!("c{coupon_id}-u{user_id}-{}", uuid::Uuid::new_v4().simple())
}

/// The coupon and buyer an order id names; `None` for anything that is not one.
pub fn parse_order_id(order_id: &str) -> Option<(i64, i64)> {
    let mut parts = order_id.splitn(3, '-');
    let coupon = parts.next()?.strip_prefix('c')?.parse().ok()?;
    let user = parts.next()?.strip_prefix('u')?.parse().ok()?;
    let random = parts.next()?;
    let well_formed =
        (1..=64).contains(&random.len()) && random.bytes().all(|byte| byte.is_ascii_hexdigit());
    well_formed.then_some((coupon, user))
}

/// How long after a sale's write is sent Redis may still apply it: each write carries a
/// fence this far ahead, past which Redis's clock makes it write nothing. A write whose
/// reply was lost is decided once its fence has passed.
pub const WRITE_WINDOW: std::time::Duration = std::time::Duration::from_secs(2);
/// How far Redis's clock may lag this host's before a fenced write could land after the
/// service concluded it did not. Same host in the embedded mode; NTP in a fleet.
pub const CLOCK_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// The current time in Unix milliseconds, by this host's clock (skewed by the test hook
/// `FLASHSALE_TEST_CLOCK_SKEW_MS`, see [`crate::faults`]).
pub fn now_millis() -> i64 {
    unix_millis(OffsetDateTime::now_utc()).saturating_add(crate::faults::clock_skew_ms())
}

/// Unix milliseconds as RFC 3339, or the number itself far outside any real date.
pub fn format_millis(millis: i64) -> String {
    rfc3339(millis).unwrap_or_else(|| millis.to_string())
}

fn rfc3339(millis: i64) -> Option<String> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis) * 1_000_000)
        .ok()
        .and_then(|at| at.format(&Rfc3339).ok())
}

fn rfc3339_millis<S: Serializer>(millis: &i64, serializer: S) -> Result<S::Ok, S::Error> {
    match rfc3339(*millis) {
        Some(text) => serializer.serialize_str(&text),
        // Only reachable for a row written by something other than this service.
        None => serializer.serialize_i64(*millis),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coupon(stock: i64) -> NewCoupon {
        NewCoupon {
            title: "Singles' Day".into(),
            stock,
            price: 999,
            starts_at: OffsetDateTime::UNIX_EPOCH,
            ends_at: OffsetDateTime::UNIX_EPOCH + time::Duration::hours(1),
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert!(coupon(1).validate().is_ok());
        assert_eq!(coupon(0).validate().unwrap_err().field, "stock");
        assert_eq!(coupon(MAX_STOCK + 1).validate().unwrap_err().field, "stock");
        let mut reversed = coupon(1);
        reversed.ends_at = reversed.starts_at;
        assert_eq!(reversed.validate().unwrap_err().field, "ends_at");
        let mut blank = coupon(1);
        blank.title = "  ".into();
        assert_eq!(blank.validate().unwrap_err().field, "title");
    }

    #[test]
    fn windows() {
        let c = Coupon {
            id: 1,
            title: "t".into(),
            stock: 1,
            price: 0,
            starts_at: 100,
            ends_at: 200,
            created_at: 0,
        };
        assert_eq!(c.window_at(99), SaleWindow::NotStarted);
        assert_eq!(c.window_at(100), SaleWindow::Open);
        assert_eq!(c.window_at(200), SaleWindow::Ended);
    }
}
