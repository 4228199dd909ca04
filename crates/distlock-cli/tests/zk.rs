//! The real `distlock` binary (built with the `zk` feature) with a `zk://` URL, against
//! a ZooKeeper ensemble (one server) each test starts: the same commands and exit codes
//! as on Redis, PostgreSQL and etcd.

mod common;

use common::{
    code, distlock, run_conflicts_and_passes_growing_tokens, run_to_end,
    shared_runs_go_together_and_an_exclusive_one_waits, stderr, token_of_a_run,
};
use distlock_testkit::ZkEnsemble;

#[tokio::test]
async fn run_holds_the_lock_passes_the_token_and_conflicts_like_on_redis() {
    let zk = ZkEnsemble::start(1).await.expect("start ZooKeeper");
    let url = zk.url();
    let token = run_conflicts_and_passes_growing_tokens(&url).await;

    // A fixed lease works as on the other stores: held, with a larger token, and freed.
    let fixed_token = token_of_a_run(&url, &["--lease", "5s"]).await;
    assert!(fixed_token > token, "{fixed_token} after {token}");
    let mut after = distlock(&url);
    after.args(["run", "job", "--no-wait", "--lease", "5s", "--", "true"]);
    let after = run_to_end(after).await;
    assert_eq!(code(&after), 0, "{}", stderr(&after));

    shared_runs_go_together_and_an_exclusive_one_waits(&url).await;
}
