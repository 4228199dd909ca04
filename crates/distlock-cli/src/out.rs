//! Writing to stdout and stderr without panicking: `println!` panics when the reader has
//! gone (`distlock list | head -1`), and a lock tool must never die on its output.

use std::io::Write;

/// Writes a line to stdout. False once the reader has gone: stop writing.
pub fn print(line: &str) -> bool {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").is_ok()
}

/// Writes `distlock: <message>` to stderr; a stderr nobody reads is ignored.
pub fn say(message: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "distlock: {message}");
}
