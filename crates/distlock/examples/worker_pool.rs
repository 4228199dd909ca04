//! A pool of workers sharing one resource (a report database that takes one writer at a
//! time), with timeouts at every step: how long a worker waits for the lock, and how
//! long a job may run. A job stops at once if its lock is lost.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run -p distlock --example worker_pool
//! ```

use std::time::Duration;

use distlock::Client;

const WORKERS: usize = 4;
const JOBS_PER_WORKER: usize = 3;
/// How long a worker waits for the resource before it gives up on a job.
const WAIT: Duration = Duration::from_secs(5);
/// How long a job may hold the resource.
const BUDGET: Duration = Duration::from_secs(2);

/// How one job ended.
#[derive(Debug)]
enum Outcome {
    Done,
    NoTurn,
    OverBudget,
    LockLost,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let client = Client::connect(&url).await?;
    let resource = client.lock("resource:report-db")?;

    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let resource = resource.clone();
        workers.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for job in 0..JOBS_PER_WORKER {
                let Some(guard) = resource.try_lock_for(WAIT).await? else {
                    outcomes.push(Outcome::NoTurn);
                    continue;
                };
                let outcome = tokio::select! {
                    finished = tokio::time::timeout(BUDGET, do_job(worker, job)) => match finished {
                        Ok(()) => Outcome::Done,
                        Err(_) => Outcome::OverBudget,
                    },
                    () = guard.lost() => Outcome::LockLost,
                };
                guard.release().await?;
                outcomes.push(outcome);
            }
            Ok::<_, distlock::Error>(outcomes)
        }));
    }
    let (mut done, mut other) = (0, Vec::new());
    for worker in workers {
        for outcome in worker.await?? {
            match outcome {
                Outcome::Done => done += 1,
                outcome => other.push(outcome),
            }
        }
    }
    println!(
        "{} jobs: {done} done, others: {other:?}",
        WORKERS * JOBS_PER_WORKER
    );
    client.shutdown().await;
    Ok(())
}

async fn do_job(worker: usize, job: usize) {
    println!("worker {worker}: job {job} has the report database");
    tokio::time::sleep(Duration::from_millis(20)).await;
}
