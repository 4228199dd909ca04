//! A write that a holder who lost its lock cannot make: the store checks the fencing
//! token. Writer A takes the lock with a short lease and stalls past it (a GC pause, a
//! slow disk, a frozen VM); writer B takes the lock and writes; then A wakes up and tries
//! to write. The lock alone cannot stop A (it no longer talks to Redis before writing);
//! the token in the row does.
//!
//! The store is SQLite here; any store with a conditional update works the same way.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run -p distlock --example fenced_write
//! ```

use std::time::Duration;

use distlock::{Client, LockGuard};
use sqlx::SqlitePool;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let client = Client::connect(&url).await?;
    let store = SqlitePool::connect("sqlite::memory:").await?;
    sqlx::query("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL, fence BIGINT NOT NULL)")
        .execute(&store)
        .await?;
    sqlx::query("INSERT INTO accounts VALUES ('alice', 100, 0)")
        .execute(&store)
        .await?;

    let lock = client.lock("account:alice")?;
    let a = lock.with_lease(Duration::from_millis(200)).lock().await?;
    println!("A holds the lock with token {}", a.fencing_token());
    tokio::time::sleep(Duration::from_millis(300)).await; // A stalls past its lease

    let b = lock.lock().await?;
    println!("B holds the lock with token {}", b.fencing_token());
    let written = fenced_add(&store, &b, 10).await?;
    println!("B adds 10: {}", if written { "written" } else { "refused" });

    let written = fenced_add(&store, &a, -100).await?;
    println!(
        "A wakes and takes 100: {}",
        if written { "written" } else { "refused" }
    );

    println!("A releases: {:?}", a.release().await?);
    println!("B releases: {:?}", b.release().await?);
    let (balance,): (i64,) = sqlx::query_as("SELECT balance FROM accounts WHERE id = 'alice'")
        .fetch_one(&store)
        .await?;
    println!("balance: {balance}");
    client.shutdown().await;
    Ok(())
}

/// Adds `delta` to alice's balance unless a holder with a newer token has written: the
/// row keeps the largest token that wrote it, and refuses smaller ones.
async fn fenced_add(store: &SqlitePool, guard: &LockGuard, delta: i64) -> sqlx::Result<bool> {
    let token = guard.fencing_token_i64();
    let updated = sqlx::query(
        "UPDATE accounts SET balance = balance + ?1, fence = ?2 WHERE id = 'alice' AND fence <= ?2",
    )
    .bind(delta)
    .bind(token)
    .execute(store)
    .await?;
    Ok(updated.rows_affected() == 1)
}
