//! Writing to stdout and stderr without panicking: `println!` panics when the reader has
//! gone (`distlock list | head -1`), and a lock tool must never die on its output.

use std::io::Write;

/// Writes a line to stdout. False once the reader has gone: stop writing.
pub fn print(line: &str) -> bool {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").is_ok()
}

/// Writes `distlock: <message>` to stderr, in one line; a stderr nobody reads is
/// ignored. Control characters left in the message (a name, or a key holding one, quoted
/// in a server's error) are escaped as [`shown`] escapes them: messages quote names
/// through [`shown`] already, and this keeps one that does not from adding lines or
/// moving the cursor.
pub fn say(message: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "distlock: {}", shown(message));
}

/// Whether `--verbose` was given.
static VERBOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_verbose(on: bool) {
    VERBOSE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// With `--verbose`: writes `distlock: <message>` to stderr, as [`say`] does. The
/// message is built only when it is written.
pub fn verbose(message: impl FnOnce() -> String) {
    if VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        say(&message());
    }
}

/// A name (or any text from Redis) as a line of text shows it: control characters
/// (a newline, a carriage return, an escape sequence) are written as escapes, so a name
/// cannot add rows to `list` or `status`, or move the cursor. JSON carries the text as
/// it is.
pub fn shown(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().collect()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(super::shown("plain name"), "plain name");
        assert_eq!(super::shown("a\nb\r\x1b"), "a\\nb\\r\\u{1b}");
    }
}
