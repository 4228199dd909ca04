//! The one syntax of every duration flag: the library's, shared with the `distlock`
//! command.

pub use distlock::{format_duration, parse_duration};
