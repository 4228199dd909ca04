//! Every kind of bad input gets the right status and a JSON error with a stable code, and
//! nothing is written: no order, no coupon, no stock taken.

mod common;

use std::time::Duration;

use common::{bounded, open_coupon, send, sqlite_service};
use flashsale::Strategy;
use redis::AsyncCommands;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_typed_errors_and_write_nothing() {
    bounded(Duration::from_secs(60), async {
        let (service, _dir) = sqlite_service(Strategy::Lua).await;
        let base = service.base_url();
        let http = reqwest::Client::new();
        let open = open_coupon(&http, &base, 5).await;
        let coupon_at = |starts: &str, ends: &str| {
            json!({"title": "window", "stock": 5, "price": 100, "starts_at": starts, "ends_at": ends})
        };
        let create = |body: serde_json::Value| {
            http.post(format!("{base}/api/coupons"))
                .header("content-type", "application/json")
                .body(body.to_string())
        };
        let not_started = send(create(coupon_at("2999-01-01T00:00:00Z", "2999-01-02T00:00:00+08:00"))).await;
        let ended = send(create(coupon_at("2001-01-01T00:00:00Z", "2001-01-02T00:00:00Z"))).await;
        assert_eq!((not_started.status, ended.status), (201, 201));
        let not_started = not_started.body["id"].as_i64().expect("id");
        let ended = ended.body["id"].as_i64().expect("id");

        let buy = |coupon: String, user: Option<&str>| {
            let request = http.post(format!("{base}/api/coupons/{coupon}/seckill"));
            match user {
                Some(user) => request.header("x-user-id", user),
                None => request,
            }
        };
        let raw_create = |body: &'static str, content_type: Option<&'static str>| {
            let request = http.post(format!("{base}/api/coupons")).body(body);
            match content_type {
                Some(value) => request.header("content-type", value),
                None => request,
            }
        };
        let good = coupon_at("2001-01-01T00:00:00Z", "2999-01-01T00:00:00Z");
        let with = |field: &str, value: serde_json::Value| {
            let mut body = good.clone();
            body[field] = value;
            create(body)
        };
        let without = |field: &str| {
            let mut body = good.clone();
            body.as_object_mut().expect("object").remove(field);
            create(body)
        };

        let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
            ("no X-User-Id", buy(open.to_string(), None), 400, "missing_user_id"),
            (
                "two X-User-Id headers",
                buy(open.to_string(), Some("1")).header("x-user-id", "2"),
                400,
                "duplicate_user_id",
            ),
            (
                "a 3 MB body",
                with("title", json!("x".repeat(3 << 20))),
                413,
                "body_too_large",
            ),
            ("non-numeric user", buy(open.to_string(), Some("alice")), 400, "invalid_user_id"),
            ("zero user", buy(open.to_string(), Some("0")), 400, "invalid_user_id"),
            ("negative user", buy(open.to_string(), Some("-7")), 400, "invalid_user_id"),
            ("huge user", buy(open.to_string(), Some("99999999999999999999")), 400, "invalid_user_id"),
            ("fractional user", buy(open.to_string(), Some("1.5")), 400, "invalid_user_id"),
            ("empty user", buy(open.to_string(), Some("")), 400, "invalid_user_id"),
            ("non-numeric coupon", buy("abc".into(), Some("1")), 400, "invalid_coupon_id"),
            ("zero coupon", buy("0".into(), Some("1")), 400, "invalid_coupon_id"),
            ("negative coupon", buy("-1".into(), Some("1")), 400, "invalid_coupon_id"),
            ("huge coupon", buy("99999999999999999999".into(), Some("1")), 400, "invalid_coupon_id"),
            ("unknown coupon", buy("424242".into(), Some("1")), 404, "coupon_not_found"),
            ("sale not started", buy(not_started.to_string(), Some("1")), 403, "sale_not_started"),
            ("sale ended", buy(ended.to_string(), Some("1")), 403, "sale_ended"),
            ("malformed JSON", raw_create("{\"title\": ", Some("application/json")), 400, "invalid_body"),
            ("JSON of the wrong shape", raw_create("[1, 2]", Some("application/json")), 400, "invalid_body"),
            ("no content type", raw_create("{}", None), 415, "unsupported_media_type"),
            ("missing stock", without("stock"), 400, "invalid_body"),
            ("stock as text", with("stock", json!("ten")), 400, "invalid_body"),
            ("fractional stock", with("stock", json!(1.5)), 400, "invalid_body"),
            ("zero stock", with("stock", json!(0)), 400, "invalid_field"),
            ("negative stock", with("stock", json!(-3)), 400, "invalid_field"),
            ("huge stock", with("stock", json!(1_000_000_000_000i64)), 400, "invalid_field"),
            ("negative price", with("price", json!(-1)), 400, "invalid_field"),
            ("blank title", with("title", json!("   ")), 400, "invalid_field"),
            ("not a date", with("starts_at", json!("tomorrow")), 400, "invalid_body"),
            ("ends before it starts", with("ends_at", json!("2000-01-01T00:00:00Z")), 400, "invalid_field"),
            ("bad user in orders", http.get(format!("{base}/api/users/x/orders")), 400, "invalid_user_id"),
            ("bad coupon lookup", http.get(format!("{base}/api/coupons/0")), 400, "invalid_coupon_id"),
            ("unknown coupon lookup", http.get(format!("{base}/api/coupons/424242")), 404, "coupon_not_found"),
            ("unknown coupon stats", http.get(format!("{base}/api/coupons/424242/stats")), 404, "coupon_not_found"),
            ("unknown route", http.get(format!("{base}/api/nothing")), 404, "not_found"),
            ("wrong method", http.get(format!("{base}/api/coupons/{open}/seckill")), 405, "method_not_allowed"),
        ];
        let mut failures = Vec::new();
        for (name, request, status, code) in cases {
            let answer = send(request).await;
            if answer.status != status || answer.body["error"] != code {
                failures.push(format!("{name}: expected {status} {code}, got {} {}", answer.status, answer.body));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));

        // Nothing was written: the three coupons created above are the only ones, no order
        // exists, and the open coupon's stock, buyers and stream are untouched.
        let coupons = service.db().coupons_ending_after(i64::MIN).await.expect("coupons");
        assert_eq!(coupons.len(), 3);
        for coupon in [open, not_started, ended] {
            assert_eq!(service.db().order_count(coupon).await.expect("count"), 0);
        }
        let mut redis = service.locks().connection();
        let keys = service.db().keyspace().coupon(open);
        let stock: i64 = redis.hget(&keys.stock, 0).await.expect("stock");
        let buyers: i64 = redis.hlen(&keys.buyers).await.expect("buyers");
        let events: i64 = redis.xlen(&keys.orders).await.expect("stream");
        assert_eq!((stock, buyers, events), (5, 0, 0));
        service.shutdown().await;
    })
    .await;
}
