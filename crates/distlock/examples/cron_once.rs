//! A job that runs at most once per period, however many hosts schedule it and whatever
//! their clocks say. Every host's cron starts it; the first to take the lock runs the
//! job and leaves the lock to expire at the end of the period, so the others skip it.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run -p distlock --example cron_once
//! ```

use std::time::Duration;

use distlock::Client;

/// How often the job runs: also how long the lock is kept after it starts.
const PERIOD: Duration = Duration::from_secs(60 * 60);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let client = Client::connect(&url).await?;
    let job = client.lock("cron:hourly-report")?.with_lease(PERIOD);

    match job.try_lock().await? {
        None => println!("skipped: another host ran the report this period"),
        Some(guard) => {
            println!(
                "running the report (fencing token {})",
                guard.fencing_token()
            );
            tokio::select! {
                () = run_report() => {
                    // Keep the lock until the period ends: no host runs it again before.
                    let left = guard.leave_to_expire();
                    println!("report done; the next run is due in {}s", left.as_secs());
                }
                () = guard.lost() => {
                    // The report ran past the period: another host may start it now.
                    eprintln!("the period ended before the report did; stopped");
                    std::process::exit(1);
                }
            }
        }
    }
    client.shutdown().await;
    Ok(())
}

async fn run_report() {
    tokio::time::sleep(Duration::from_millis(50)).await;
}
