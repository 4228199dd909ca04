//! One background thread for every client of a process (issue 21: each client started its
//! own, so a five-master RedLock started five), ended when the last client is gone. Its
//! own test binary: it counts the process's threads.

mod common;

use std::time::Duration;

use common::bounded;
use distlock::{Client, RedLock};
use distlock_testkit::RedisServer;

/// How many threads of this process are distlock's background thread.
fn distlock_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| task.ok())
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.trim() == "distlock")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_share_one_background_thread_which_ends_with_the_last() {
    let servers = [
        RedisServer::start().await.unwrap(),
        RedisServer::start().await.unwrap(),
        RedisServer::start().await.unwrap(),
        RedisServer::start().await.unwrap(),
        RedisServer::start().await.unwrap(),
    ];
    assert_eq!(distlock_threads(), 0);
    let mut masters = Vec::new();
    for server in &servers {
        masters.push(Client::connect(&server.url()).await.unwrap());
    }
    assert_eq!(distlock_threads(), 1, "five clients, one thread");
    bounded(Duration::from_secs(20), async {
        let lock = RedLock::new("shared-thread", &masters).unwrap();
        let guard = lock.lock().await.unwrap();
        assert_eq!(guard.granted_by(), 5);
        // Shutting one client down leaves the others working.
        masters[0].shutdown().await;
        guard.release().await.unwrap();
        let again = Client::connect(&servers[1].url()).await.unwrap();
        common::lock_once(&again, "after-one-shutdown").await;
        masters.push(again);
    })
    .await;
    drop(masters);
    common::eventually(Duration::from_secs(5), "the thread ended", || async {
        distlock_threads() == 0
    })
    .await;
    // The next client starts it again.
    let client = Client::connect(&servers[0].url()).await.unwrap();
    common::lock_once(&client, "restarted").await;
    assert_eq!(distlock_threads(), 1);
}
