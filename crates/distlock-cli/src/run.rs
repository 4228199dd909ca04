//! `distlock run` and `distlock elect`: hold the lock, run the command, and stop the
//! command when the lock is lost.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::args::{Elect, Hold, Run};
use crate::child::{code_of, Child, Forwarded};
use crate::exit::{self, Failure};
use crate::held::{take, Held, Patience};
use crate::mark::Mark;

/// How often a holder asks the server whether the lock is still its own (one HEXISTS):
/// a force-unlock is noticed this fast, not at the next renewal (every 10 s).
const VERIFY_EVERY: Duration = Duration::from_millis(500);

/// How long the clean-up after the command (the mark, the release) may take.
const CLEANUP_LIMIT: Duration = Duration::from_secs(2);

/// How often `elect` tries again while Redis cannot be reached.
const UNAVAILABLE_RETRY: Duration = Duration::from_secs(1);

/// How a command under the lock ended.
enum Ended {
    /// It exited by itself (or on a signal passed on to it), while the lock was held.
    Exited(std::process::ExitStatus),
    /// The lock was lost, and the command stopped.
    Lost,
}

/// `distlock run`.
pub async fn run(client: &distlock::Client, args: &Run) -> Result<u8, Failure> {
    let mut signals = Forwarded::install()?;
    let patience = match (args.no_wait, args.wait) {
        (true, _) => Patience::None,
        (false, Some(wait)) => Patience::Within(wait),
        (false, None) => Patience::Forever,
    };
    let taken = tokio::select! {
        taken = take(client, &args.hold, patience) => taken?,
        signal = signals.next() => return Ok(signal_code(signal)),
    };
    let Some(held) = taken else {
        eprintln!(
            "distlock: {} is held by someone else; not run",
            args.hold.name
        );
        return Ok(args.conflict_exit_code);
    };
    match hold_and_run(client, &args.hold, held, &mut signals).await? {
        Ended::Exited(status) => Ok(code_of(status)),
        Ended::Lost => {
            eprintln!(
                "distlock: lost {} while the command ran; it was stopped",
                args.hold.name
            );
            Ok(exit::LOST)
        }
    }
}

/// `distlock elect`.
pub async fn elect(client: &distlock::Client, args: &Elect) -> Result<u8, Failure> {
    let mut signals = Forwarded::install()?;
    loop {
        let taken = tokio::select! {
            taken = take(client, &args.hold, Patience::Forever) => taken,
            signal = signals.next() => return Ok(signal_code(signal)),
        };
        let held = match taken {
            Ok(Some(held)) => held,
            Ok(None) => continue,
            Err(failure) if failure.code == exit::UNAVAILABLE => {
                eprintln!("distlock: {}; trying again", failure.message);
                tokio::select! {
                    () = tokio::time::sleep(UNAVAILABLE_RETRY) => continue,
                    signal = signals.next() => return Ok(signal_code(signal)),
                }
            }
            Err(failure) => return Err(failure),
        };
        eprintln!(
            "distlock: leading {}{}; starting the command",
            args.hold.name,
            held.token()
                .map(|token| format!(" (fencing token {token})"))
                .unwrap_or_default()
        );
        match hold_and_run(client, &args.hold, held, &mut signals).await? {
            Ended::Exited(status) => return Ok(code_of(status)),
            Ended::Lost => eprintln!(
                "distlock: lost {}; the command was stopped; taking the lock again",
                args.hold.name
            ),
        }
    }
}

/// Runs the command while `held` lasts, then gives it back.
async fn hold_and_run(
    client: &distlock::Client,
    hold: &Hold,
    held: Held,
    signals: &mut Forwarded,
) -> Result<Ended, Failure> {
    let owner = held.owner();
    let mut mark = held.is_exclusive().then(|| Mark::new(client, &hold.name));
    if let Some(mark) = &mut mark {
        mark.wait_for_others(&owner).await?;
        mark.set(&owner, held.lease_remaining()).await?;
    }
    let mut env = vec![
        ("DISTLOCK_NAME", hold.name.clone()),
        ("DISTLOCK_OWNER", owner.clone()),
    ];
    if let Some(token) = held.token() {
        env.push(("DISTLOCK_FENCING_TOKEN", token.to_string()));
    }
    let ended = match Child::spawn(&hold.command, &env) {
        Ok(mut child) => {
            supervise(
                &mut child,
                &held,
                hold.kill_grace,
                signals,
                mark.as_mut(),
                &owner,
            )
            .await
        }
        Err(failure) => Err(failure),
    };
    // The command has exited, whatever happened: its mark can go, then the lock. Bounded:
    // after a loss Redis may be unreachable, and nothing is left to protect.
    let cleanup = async {
        if let Some(mark) = &mut mark {
            if let Err(failure) = mark.clear(&owner).await {
                eprintln!(
                    "distlock: could not clear the running mark ({}); it expires with the lease",
                    failure.message
                );
            }
        }
        match &ended {
            // Not ours any more: nothing to give back.
            Ok(Ended::Lost) => held.abandon(),
            // Exited, or never started: give it back.
            _ => match held.release().await {
                Ok(outcome) if outcome.was_lost() => {
                    eprintln!("distlock: the lock had been lost by the time the command exited");
                }
                Ok(_) => {}
                Err(failure) => eprintln!(
                    "distlock: could not release the lock ({}); it expires with its lease",
                    failure.message
                ),
            },
        }
    };
    if tokio::time::timeout(CLEANUP_LIMIT, cleanup).await.is_err() {
        eprintln!(
            "distlock: Redis did not answer the clean-up in time; the lock expires with its lease"
        );
    }
    ended
}

/// Waits for the command to exit, passing signals on, and stops it when the lock is lost
/// or its loss is seen coming.
async fn supervise(
    child: &mut Child,
    held: &Held,
    kill_grace: Duration,
    signals: &mut Forwarded,
    mut mark: Option<&mut Mark>,
    owner: &str,
) -> Result<Ended, Failure> {
    // A lease too short for the whole grace gets half of it: SIGTERM at half the lease.
    let grace = kill_grace.min(held.lease_remaining() / 2);
    let mut lost = held.lost();
    // The check runs beside the other branches, so a slow or stopped Redis never holds
    // up the stop at the lease's end.
    let mut check = Box::pin(check_after(held, mark.as_deref_mut(), owner));
    loop {
        // When the lease would end within the grace: renewals have not kept it up.
        let coming = Instant::now() + held.lease_remaining().saturating_sub(grace);
        tokio::select! {
            status = child.wait() => return Ok(Ended::Exited(status?)),
            signal = signals.next() => child.signal(signal),
            () = &mut lost => {
                // Gone already (taken away, or its deadline passed): the grace is all
                // the command gets.
                child.stop(Instant::now() + kill_grace).await?;
                return Ok(Ended::Lost);
            }
            () = tokio::time::sleep_until(coming) => {
                let left = held.lease_remaining();
                if left <= grace {
                    // SIGTERM now, SIGKILL as the lease ends: never past it.
                    child.stop(Instant::now() + left).await?;
                    return Ok(Ended::Lost);
                }
            }
            still_held = &mut check => {
                if !still_held {
                    child.stop(Instant::now() + kill_grace).await?;
                    return Ok(Ended::Lost);
                }
                drop(check);
                check = Box::pin(check_after(held, mark.as_deref_mut(), owner));
            }
        }
    }
}

/// After [`VERIFY_EVERY`], asks whether the lock is still held, and keeps the running
/// mark as long as the lease just confirmed. False only when the server says it is not
/// held: an unreachable Redis leaves the decision to the lease's own deadline.
async fn check_after(held: &Held, mark: Option<&mut Mark>, owner: &str) -> bool {
    tokio::time::sleep(VERIFY_EVERY).await;
    match held.verify().await {
        Ok(false) => false,
        Ok(true) => {
            if let Some(mark) = mark {
                let _ = mark.set(owner, held.lease_remaining()).await;
            }
            true
        }
        Err(_) => true,
    }
}

/// The exit code for ending on `signal` before the command ran: as a shell reports it.
fn signal_code(signal: Signal) -> u8 {
    128 + signal as u8
}
