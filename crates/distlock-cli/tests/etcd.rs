//! The real `distlock` binary (built with the `etcd` feature) with an `etcd://` URL,
//! against a 3-member etcd cluster each test starts: the same commands and exit codes as
//! on Redis and PostgreSQL.

mod common;

use common::{
    run_conflicts_and_passes_growing_tokens, shared_runs_go_together_and_an_exclusive_one_waits,
};
use distlock_testkit::EtcdCluster;

#[tokio::test]
async fn run_holds_the_lock_passes_the_token_and_conflicts_like_on_redis() {
    let etcd = EtcdCluster::start(3).await.expect("start etcd");
    let url = etcd.url();
    run_conflicts_and_passes_growing_tokens(&url).await;
    shared_runs_go_together_and_an_exclusive_one_waits(&url).await;
}
