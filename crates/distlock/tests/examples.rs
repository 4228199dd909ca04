//! The programs in examples/ run as a user would run them: against a real Redis named by
//! REDIS_URL, with nothing from the testkit inside them. `cargo test` builds them first.

mod common;

use common::examples;
use distlock_testkit::RedisServer;

#[tokio::test]
async fn the_cron_job_runs_once_per_period() {
    let server = RedisServer::start().await.unwrap();
    examples::cron_runs_once(&server.url(), None);
}

#[tokio::test]
async fn the_fenced_write_refuses_the_stale_writer() {
    let server = RedisServer::start().await.unwrap();
    examples::fenced_write_refuses_the_stale_writer(&server.url(), None);
}

#[tokio::test]
async fn the_worker_pool_does_every_job() {
    let server = RedisServer::start().await.unwrap();
    examples::worker_pool_does_every_job(&server.url(), None);
}
