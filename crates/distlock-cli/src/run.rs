//! `distlock run` and `distlock elect`: hold the lock, run the command, and stop the
//! command when the lock is lost.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::args::{Elect, Hold, Waiting};
use crate::child::{code_of, signal_code, Child, Forwarded};
use crate::exit::{self, Failure};
use crate::held::{preflight, take, Held, Patience};
use crate::holder::{Info, Record};
use crate::mark::Mark;
use crate::out::{say, verbose};

/// How often a holder asks the server whether the lock is still its own (one round
/// trip): a force-unlock or a restarted Redis is noticed this fast, not at the next
/// renewal (every third of the ttl).
const VERIFY_EVERY: Duration = Duration::from_millis(500);

/// How long the clean-up after the command (the mark, the release) may take.
const CLEANUP_LIMIT: Duration = Duration::from_secs(1);

/// How often `elect` tries again while Redis cannot be reached.
const UNAVAILABLE_RETRY: Duration = Duration::from_secs(1);

/// How a command under the lock ended.
enum Ended {
    /// It exited by itself (or on a signal passed on to it), while the lock was held.
    Exited(std::process::ExitStatus),
    /// It was stopped: the lock was lost, or its lease was about to end.
    Stopped(Why),
    /// A signal came before the command started; it never ran.
    Signalled(Signal),
    /// The previous holder's command was still stopping when the caller's patience ran
    /// out (`--no-wait`, `--wait`); the command never ran.
    Busy,
    /// The lock was lost while the previous holder's command was stopping; the command
    /// never ran.
    LostBeforeStart,
}

/// Why a command was stopped.
#[derive(Debug, Clone, Copy)]
enum Why {
    /// The server says the lock is no longer this holder's (a force-unlock, a restart
    /// without persistence), or its deadline passed without a renewal.
    Lost,
    /// The lease would end within the grace: a fixed `--lease` running out, or renewals
    /// that did not get through.
    LeaseEnding { fixed: bool },
    /// The lease had ended by the time distlock looked: `late` after its end by the local
    /// clock (distlock was stopped, or starved, or renewals failed to the last moment).
    LeaseEnded { late: Duration },
}

impl Why {
    /// What happened, for the holder of `name`; `command`: whether a command ran under
    /// it (`hold` has none, and says nothing of one).
    fn describe(self, name: &str, command: bool) -> String {
        let stopped = if command {
            "; the command was stopped"
        } else {
            "; let go of it"
        };
        match self {
            Why::Lost if command => {
                format!(
                    "lost {name} (force-unlocked or deleted) while the command ran; it was stopped"
                )
            }
            Why::Lost => format!("lost {name} (force-unlocked or deleted)"),
            Why::LeaseEnding { fixed: true } => {
                format!("the --lease on {name} was running out{stopped}")
            }
            Why::LeaseEnding { fixed: false } if command => format!(
                "could not renew {name} in time (the renewals did not get through); the command \
                 was stopped before the lease ran out"
            ),
            Why::LeaseEnding { fixed: false } => format!(
                "could not renew {name} in time (the renewals did not get through); let go of \
                 it before the lease ran out"
            ),
            Why::LeaseEnded { late } if late >= PAUSED => format!(
                "the lease on {name} ended {:.1}s before distlock could act (was distlock \
                 stopped, or its machine paused?){stopped}",
                late.as_secs_f64()
            ),
            Why::LeaseEnded { .. } => {
                format!("the lease on {name} ended before it was renewed{stopped}")
            }
        }
    }
}

/// How late after the lease's end distlock must act to say it was paused.
const PAUSED: Duration = Duration::from_millis(500);

/// `distlock run`, and `distlock hold` (no `command`: the lock is held until a signal).
pub async fn run(
    client: &distlock::Client,
    hold: &Hold,
    command: Option<Vec<std::ffi::OsString>>,
    args: &Waiting,
) -> Result<u8, Failure> {
    let mut signals = Forwarded::install()?;
    let patience = match (args.no_wait, args.wait) {
        (true, _) => Patience::None,
        (false, Some(wait)) => Patience::Within(wait),
        (false, None) => Patience::Forever,
    };
    // The wait for the previous holder's command shares the caller's patience.
    let deadline = match patience {
        Patience::None => Some(Instant::now()),
        Patience::Within(wait) => Some(Instant::now() + wait),
        Patience::Forever => None,
    };
    let taken = tokio::select! {
        taken = async {
            preflight(client, hold).await?;
            verbose(|| {
                let wait = match patience {
                    Patience::None => "without waiting".to_owned(),
                    Patience::Within(wait) => {
                        format!("waiting at most {}", distlock::format_duration(wait))
                    }
                    Patience::Forever => "waiting as long as it takes".to_owned(),
                };
                format!("taking {}, {wait}", crate::out::shown(&hold.name))
            });
            take(client, hold, patience).await
        } => taken?,
        signal = signals.next() => return Ok(signal_code(signal)),
    };
    let Some(held) = taken else {
        say(&busy_reason(client, hold).await);
        return Ok(args.conflict_exit_code);
    };
    let job = Job {
        hold,
        command: command.as_deref(),
        announce: None,
    };
    match hold_and_run(client, job, held, &mut signals, deadline).await? {
        Ended::Exited(status) => Ok(code_of(status)),
        Ended::Signalled(signal) => Ok(signal_code(signal)),
        Ended::Busy => {
            say(&format!(
                "the previous holder's command on {} is still stopping; not run",
                crate::out::shown(&hold.name)
            ));
            Ok(args.conflict_exit_code)
        }
        Ended::LostBeforeStart => {
            say(&format!(
                "lost {} before the command started; not run",
                crate::out::shown(&hold.name)
            ));
            Ok(exit::LOST)
        }
        Ended::Stopped(why) => {
            say(&why.describe(&crate::out::shown(&hold.name), command.is_some()));
            Ok(exit::LOST)
        }
    }
}

/// Connects for `elect`, trying again while Redis cannot be reached: a leader started
/// before its Redis (at boot) waits for it instead of exiting.
pub async fn connect_for_elect(
    connect: impl AsyncFn() -> Result<distlock::Client, Failure>,
) -> Result<Result<distlock::Client, u8>, Failure> {
    let mut signals = Forwarded::install()?;
    loop {
        match connect().await {
            Ok(client) => return Ok(Ok(client)),
            Err(failure) if failure.code == exit::UNAVAILABLE => {
                say(&format!("{}; trying again", failure.message));
                tokio::select! {
                    () = tokio::time::sleep(UNAVAILABLE_RETRY) => {}
                    signal = signals.next() => return Ok(Err(signal_code(signal))),
                }
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// `distlock elect`.
pub async fn elect(client: &distlock::Client, args: &Elect) -> Result<u8, Failure> {
    let hold = &args.hold;
    let command = args.program.argv();
    let mut signals = Forwarded::install()?;
    loop {
        let taken = tokio::select! {
            taken = async {
                preflight(client, hold).await?;
                take(client, hold, Patience::Forever).await
            } => taken,
            signal = signals.next() => return Ok(signal_code(signal)),
        };
        let held = match taken {
            Ok(Some(held)) => held,
            Ok(None) => continue,
            Err(failure) if failure.code == exit::UNAVAILABLE => {
                if unavailable(&failure, &mut signals).await.is_some() {
                    return Ok(exit::LOST);
                }
                continue;
            }
            Err(failure) => return Err(failure),
        };
        // Said once the command starts: after the previous holder's command is gone.
        let announce = format!(
            "leading {}{}; starting the command",
            crate::out::shown(&hold.name),
            held.token()
                .map(|token| format!(" (fencing token {token})"))
                .unwrap_or_default()
        );
        let job = Job {
            hold,
            command: Some(&command),
            announce: Some(&announce),
        };
        match hold_and_run(client, job, held, &mut signals, None).await {
            Ok(Ended::Exited(status)) => return Ok(code_of(status)),
            Ok(Ended::Signalled(signal)) => return Ok(signal_code(signal)),
            Ok(Ended::Busy | Ended::LostBeforeStart) => {
                say(&format!(
                    "lost {} before the command started; taking it again",
                    crate::out::shown(&hold.name)
                ));
            }
            Ok(Ended::Stopped(why)) => say(&format!(
                "{}; taking the lock again",
                why.describe(&crate::out::shown(&hold.name), true)
            )),
            // The mark could not be read or written (Redis went away): try again.
            Err(failure) if failure.code == exit::UNAVAILABLE => {
                if let Some(signal) = unavailable(&failure, &mut signals).await {
                    return Ok(signal_code(signal));
                }
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// Reports `failure` and waits before the next try; a signal instead ends the wait.
async fn unavailable(failure: &Failure, signals: &mut Forwarded) -> Option<Signal> {
    say(&format!("{}; trying again", failure.message));
    tokio::select! {
        () = tokio::time::sleep(UNAVAILABLE_RETRY) => None,
        signal = signals.next() => Some(signal),
    }
}

/// What runs under the lock.
#[derive(Clone, Copy)]
struct Job<'a> {
    hold: &'a Hold,
    /// `None`: no command (`distlock hold`), held until a signal.
    command: Option<&'a [std::ffi::OsString]>,
    /// Said on stderr as the command starts.
    announce: Option<&'a str>,
}

/// Runs the command while `held` lasts, then gives it back: on every path, once the
/// lock is taken, the mark and the lock are cleaned up.
async fn hold_and_run(
    client: &distlock::Client,
    job: Job<'_>,
    held: Held,
    signals: &mut Forwarded,
    deadline: Option<Instant>,
) -> Result<Ended, Failure> {
    let owner = held.owner();
    verbose(|| {
        format!(
            "took {} as {}{}, lease {:.1}s left",
            crate::out::shown(&job.hold.name),
            crate::out::shown(&owner),
            held.token()
                .map(|token| format!(" with fencing token {token}"))
                .unwrap_or_default(),
            held.lease_remaining().as_secs_f64()
        )
    });
    let mark = match &held {
        Held::Lock(_) => Some(Mark::new(client, &job.hold.name)),
        Held::Read(_) => Some(Mark::shared(client, &job.hold.name)),
        Held::Permit(_) => None,
    };
    let mut beside = Beside {
        mark,
        record: Record::new(client, &job.hold.name, &owner),
    };
    let ended = run_marked(job, &held, signals, &mut beside, &owner, deadline).await;
    // The command has exited, whatever happened: its mark can go, then the lock. Bounded:
    // after a loss Redis may be unreachable, and nothing is left to protect.
    let cleanup = async {
        beside.record.clear().await;
        if let Some(mark) = &mut beside.mark {
            if let Err(failure) = mark.clear(&owner).await {
                say(&format!(
                    "could not clear the running mark ({}); it expires with the lease",
                    failure.message
                ));
            }
        }
        verbose(|| "the command's process group is gone; giving the lock back".into());
        match &ended {
            // Not ours any more: nothing to give back.
            Ok(Ended::Stopped(Why::Lost | Why::LeaseEnded { .. }) | Ended::LostBeforeStart) => {
                held.abandon()
            }
            _ => match held.release().await {
                Ok(outcome) if outcome.was_lost() && matches!(ended, Ok(Ended::Exited(_))) => {
                    say("the lock had been lost by the time the command exited");
                }
                Ok(_) => verbose(|| "released".into()),
                Err(failure) => say(&format!(
                    "could not release the lock ({}); it expires with its lease",
                    failure.message
                )),
            },
        }
    };
    if tokio::time::timeout(CLEANUP_LIMIT, cleanup).await.is_err() {
        say("Redis did not answer the clean-up in time; the lock expires with its lease");
    }
    ended
}

/// Waits for the previous holder's command to be gone, marks the lock, and runs the
/// command under it.
async fn run_marked(
    job: Job<'_>,
    held: &Held,
    signals: &mut Forwarded,
    beside: &mut Beside,
    owner: &str,
    deadline: Option<Instant>,
) -> Result<Ended, Failure> {
    let Job {
        hold,
        command,
        announce,
    } = job;
    if let Some(mark) = beside.mark.as_mut() {
        tokio::select! {
            claimed = mark.claim(owner, held.lease_remaining(), deadline) => {
                if !claimed? {
                    return Ok(Ended::Busy);
                }
                verbose(|| format!("marked the command as running ({})", crate::out::shown(mark.key())));
            }
            signal = signals.next() => return Ok(Ended::Signalled(signal)),
        }
        // The wait may have been long: the lock may have been taken from this holder
        // meanwhile (a force-unlock while it waited), and another may be waiting on
        // this mark now.
        if !held.verify().await? {
            return Ok(Ended::LostBeforeStart);
        }
    }
    let mut env = vec![
        ("DISTLOCK_NAME", hold.name.clone()),
        ("DISTLOCK_OWNER", owner.to_owned()),
    ];
    if let Some(token) = held.token() {
        env.push(("DISTLOCK_FENCING_TOKEN", token.to_string()));
    }
    if let Some(announce) = announce {
        say(announce);
    }
    let mut child = match command {
        Some(command) => {
            let child = Child::spawn(command, &env)?;
            verbose(|| format!("started the command {command:?} ({})", child.describe()));
            child
        }
        // `distlock hold`: what a command would be told goes to stdout, and the lock is
        // held until a signal.
        None => {
            for (key, value) in &env {
                crate::out::print(&format!("{key}={}", crate::out::shown(value)));
            }
            Child::idle()
        }
    };
    // Who holds it, for status and list: bounded, as the command runs already.
    let info = Info::now(command, child.pid());
    let _ = tokio::time::timeout(
        RECORD_LIMIT,
        beside.record.write(&info, held.lease_remaining()),
    )
    .await;
    let (why, kill_by) = match supervise(&mut child, held, hold, signals, beside, owner).await? {
        Supervised::Exited(status) => return Ok(Ended::Exited(status)),
        Supervised::Stop { why, kill_by } => (why, kill_by),
    };
    // SIGTERM at once: the grace was counted back from the lease's end, and no network
    // wait may come before it.
    verbose(|| {
        format!(
            "stopping the command ({why:?}): SIGTERM now, SIGKILL in {:.3}s at the latest",
            kill_by
                .saturating_duration_since(Instant::now())
                .as_secs_f64()
        )
    });
    child.terminate();
    // The mark must outlive the command: extended over the grace if Redis answers by
    // then, and if not, the command is killed before the mark runs out.
    let kill_at = match beside.mark.as_mut() {
        Some(mark) => {
            let budget = kill_by.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(budget, mark.cover(owner, kill_by)).await;
            match mark.expires_at() {
                Some(expires_at) => {
                    kill_by.min(expires_at.checked_sub(MARK_MARGIN).unwrap_or(expires_at))
                }
                None => kill_by,
            }
        }
        None => kill_by,
    };
    child.stop(kill_at).await?;
    Ok(Ended::Stopped(why))
}

/// What a holder keeps beside the lock while its command runs: the running mark (of a
/// lock; a shared holder's only waits), and the record of who holds it.
struct Beside {
    mark: Option<Mark>,
    record: Record,
}

/// How long writing the holder's record may hold up the supervision of a command that
/// has started.
const RECORD_LIMIT: Duration = Duration::from_millis(300);

/// How often the group of a command that has exited is looked at, while jobs it left in
/// the background still run.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// How long before the mark expires a stopped command is killed at the latest.
const MARK_MARGIN: Duration = Duration::from_millis(100);

/// What supervising the command decided.
enum Supervised {
    Exited(std::process::ExitStatus),
    /// Stop it, killing what is left of it by `kill_by`.
    Stop {
        why: Why,
        kill_by: Instant,
    },
}

/// Waits for the command to exit, passing signals on, and decides to stop it when the
/// lock is lost or its loss is seen coming.
async fn supervise(
    child: &mut Child,
    held: &Held,
    hold: &Hold,
    signals: &mut Forwarded,
    beside: &mut Beside,
    owner: &str,
) -> Result<Supervised, Failure> {
    // A lease too short for the whole grace gets half of it: SIGTERM at half the lease.
    let grace = hold.kill_grace.min(held.lease_remaining() / 2);
    let fixed = hold.lease.is_some();
    let mut lost = held.lost();
    // The check runs beside the other branches, so a slow or stopped Redis never holds
    // up the stop at the lease's end.
    let mut check = Box::pin(check_after(held, &mut *beside, owner));
    // The command's own exit status, once it has exited: the lock is kept until the rest
    // of its process group (jobs it left in the background) is gone too.
    let mut exited = None;
    // The lease's end as last known while it was held, by the local clock: a holding
    // known to be lost reads zero left, whether it was taken away or ran out, so the
    // end it had is kept here to tell the two apart.
    let mut lease_end = Instant::now() + held.lease_remaining();
    loop {
        let left = held.lease_remaining();
        if !left.is_zero() {
            lease_end = Instant::now() + left;
        }
        // When the lease would end within the grace: renewals have not kept it up.
        let coming = lease_end.checked_sub(grace).unwrap_or(lease_end);
        // Why a loss found now happened: the lease ran out unseen (distlock was stopped,
        // or renewals failed to the last moment), or, its end still ahead, the lock was
        // taken away (a force-unlock, a deleted key, a Redis restarted without its data).
        let lost_why = || {
            let now = Instant::now();
            if now >= lease_end {
                Why::LeaseEnded {
                    late: now.saturating_duration_since(lease_end),
                }
            } else {
                Why::Lost
            }
        };
        tokio::select! {
            status = child.wait(), if exited.is_none() => {
                let status = status?;
                verbose(|| format!("the command exited: {status}"));
                if !child.group_alive() {
                    return Ok(Supervised::Exited(status));
                }
                exited = Some(status);
            }
            () = tokio::time::sleep(GROUP_POLL), if exited.is_some() => {
                if let (Some(status), false) = (exited, child.group_alive()) {
                    return Ok(Supervised::Exited(status));
                }
            }
            signal = signals.next() => {
                verbose(|| format!("passing {signal} on to the command"));
                child.signal(signal);
            }
            () = &mut lost => {
                // Gone already (taken away, or its deadline passed): the grace is all
                // the command gets, and never past a lease still running.
                return Ok(Supervised::Stop { why: lost_why(), kill_by: Instant::now() + grace_within(held, hold) });
            }
            () = tokio::time::sleep_until(coming) => {
                let left = held.lease_remaining();
                if left.is_zero() {
                    return Ok(Supervised::Stop { why: lost_why(), kill_by: Instant::now() + grace_within(held, hold) });
                }
                if left <= grace {
                    // SIGTERM now, SIGKILL as the lease ends: never past it.
                    return Ok(Supervised::Stop {
                        why: Why::LeaseEnding { fixed },
                        kill_by: Instant::now() + left,
                    });
                }
            }
            still_held = &mut check => {
                if !still_held {
                    return Ok(Supervised::Stop { why: lost_why(), kill_by: Instant::now() + grace_within(held, hold) });
                }
                drop(check);
                check = Box::pin(check_after(held, &mut *beside, owner));
            }
        }
    }
}

/// The grace of a command whose lock is lost: `--kill-grace`, cut to what is left of the
/// lease by the local clock when some is (the server may still count it as held, and the
/// next holder may come at its end).
fn grace_within(held: &Held, hold: &Hold) -> Duration {
    let left = held.lease_remaining();
    if left.is_zero() {
        hold.kill_grace
    } else {
        hold.kill_grace.min(left)
    }
}

/// After [`VERIFY_EVERY`], asks whether the lock is still held, and keeps the running
/// mark as long as the lease just confirmed. False only when the server says it is not
/// held: an unreachable Redis leaves the decision to the lease's own deadline.
async fn check_after(held: &Held, beside: &mut Beside, owner: &str) -> bool {
    tokio::time::sleep(VERIFY_EVERY).await;
    match held.verify().await {
        Ok(false) => false,
        Ok(true) => {
            if let Some(mark) = &mut beside.mark {
                let _ = mark.set(owner, held.lease_remaining()).await;
            }
            beside.record.keep(held.lease_remaining()).await;
            true
        }
        Err(_) => true,
    }
}

/// Why the lock could not be taken without waiting. A fair lock can be free and still not
/// be taken: others are queued ahead. Its queue is named by the name's hash tag (Redisson's
/// layout), so `x` and `{x}` share one, and waiters of either are ahead of both.
async fn busy_reason(client: &distlock::Client, hold: &Hold) -> String {
    let name = crate::out::shown(&hold.name);
    if hold.fair {
        if let Ok(lock) = client.fair_lock(&hold.name) {
            if let (Ok(false), Ok(queued)) = (lock.is_locked().await, lock.queued().await) {
                if queued > 0 {
                    return format!(
                        "{name} is free, but {queued} waiter(s) are queued ahead in its fair \
                         queue, which every name with the same hash tag shares (x and {{x}}, \
                         as in Redisson's layout); not run"
                    );
                }
            }
        }
    }
    format!("{name} is held by someone else; not run")
}
