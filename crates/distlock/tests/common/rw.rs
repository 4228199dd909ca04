//! What a read-write lock promises on every store, as one scenario each store's tests run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::Client;

/// Six tasks on `clients` (taken in turn) read and write lock `name` ten rounds each: a
/// writer is never in with anyone, and write tokens never repeat. Answers the most
/// readers seen in together, for the caller to assert they shared.
pub async fn writers_exclude_everyone_and_readers_share(clients: &[Client], name: &str) -> usize {
    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let most_readers = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for n in 0..6 {
        let lock = clients[n % clients.len()].rw_lock(name).unwrap();
        let (readers, writers, most) = (
            Arc::clone(&readers),
            Arc::clone(&writers),
            Arc::clone(&most_readers),
        );
        let tokens = Arc::clone(&tokens);
        tasks.push(tokio::spawn(async move {
            for round in 0..10 {
                if (n + round) % 3 == 0 {
                    let guard = lock.write().await.unwrap();
                    assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                    assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer with readers");
                    tokens.lock().unwrap().push(guard.fencing_token());
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    writers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                } else {
                    let guard = lock.read().await.unwrap();
                    let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    assert_eq!(writers.load(Ordering::SeqCst), 0, "a reader with a writer");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    readers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut tokens = tokens.lock().unwrap().clone();
    let handed_out = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), handed_out, "a write token repeated");
    most_readers.load(Ordering::SeqCst)
}
