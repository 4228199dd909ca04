//! The crate's layers import only downward, and no source file grows past what a reader can
//! hold. See docs/design.md for the picture.
//!
//! Layers, from the bottom: the leaves (`config`, `error`, `duration`, `runtime`,
//! `deadline_clock`, `crc16`), then `transport`, `engine`, `primitives`, `client`, and
//! `lib.rs`, which only re-exports. A
//! file may name `crate::<module>` only for a module of its own layer or one below.

use std::path::{Path, PathBuf};

/// The layer of a top-level module of the crate.
fn layer(module: &str) -> Option<u8> {
    Some(match module {
        "config" | "error" | "duration" | "runtime" | "deadline_clock" | "crc16" => 0,
        "transport" => 1,
        "engine" => 2,
        "primitives" => 3,
        "client" => 4,
        _ => return None,
    })
}

/// The longest a source file may be, in lines.
const MAX_LINES: usize = 720;

fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).expect("the crate's src/ is readable");
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

/// Every `crate::<module>` a line of code names, comments left out.
fn named_modules(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or_default();
    code.match_indices("crate::")
        .map(|(at, _)| {
            code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn layers_import_only_downward_and_files_stay_short() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut breaks = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src/");
        let top = relative
            .components()
            .next()
            .and_then(|part| part.as_os_str().to_str())
            .map(|part| part.trim_end_matches(".rs"))
            .unwrap_or_default();
        let text = std::fs::read_to_string(file).expect("a readable source file");
        let lines = text.lines().count();
        if lines > MAX_LINES {
            breaks.push(format!(
                "{}: {lines} lines (at most {MAX_LINES})",
                relative.display()
            ));
        }
        if top == "lib" {
            continue;
        }
        let own = layer(top).unwrap_or_else(|| panic!("{top}: a module with no layer"));
        for (number, line) in text.lines().enumerate() {
            for module in named_modules(line) {
                let Some(theirs) = layer(&module) else {
                    breaks.push(format!(
                        "{}:{}: crate::{module} has no layer",
                        relative.display(),
                        number + 1
                    ));
                    continue;
                };
                if theirs > own {
                    breaks.push(format!(
                        "{}:{}: `{top}` imports `{module}`, a layer above it",
                        relative.display(),
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(breaks.is_empty(), "{}", breaks.join("\n"));
}
