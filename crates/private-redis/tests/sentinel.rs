//! A private Redis started with `Builder::sentinel` runs in Sentinel mode with the given
//! configuration, and keeps what it learned across a restart.

use std::future::Future;
use std::time::Duration;

use private_redis::PrivateRedis;

async fn bounded<T>(future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), future)
        .await
        .expect("test step did not finish within 60 s")
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME mymaster` on the Sentinel at `url`.
async fn monitored_master(url: &str) -> Option<(String, String)> {
    let mut conn = redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg("mymaster")
        .query_async(&mut conn)
        .await
        .expect("SENTINEL GET-MASTER-ADDR-BY-NAME")
}

#[tokio::test]
async fn a_sentinel_monitors_what_its_config_says_across_a_restart() {
    bounded(async {
        // Nothing listens on port 1; a Sentinel monitors a master whether it is up or not.
        let mut sentinel = PrivateRedis::ephemeral()
            .sentinel("sentinel monitor mymaster 127.0.0.1 1 1\n")
            .start()
            .await
            .expect("start a sentinel");
        let expected = Some(("127.0.0.1".to_owned(), "1".to_owned()));
        assert_eq!(monitored_master(&sentinel.url()).await, expected);

        sentinel.restart().await.expect("restart the sentinel");
        assert_eq!(monitored_master(&sentinel.url()).await, expected);
    })
    .await
}
