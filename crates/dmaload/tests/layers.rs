//! The core's top-level modules form layers: no module imports another that
//! imports it back, however long the way round. The imports are read from
//! the source itself (`crate::…` paths in code, comments and inline test
//! modules left out), so a new module or a new import is checked without
//! any list to keep. The model-cache crate (`crates/dmaload-share`),
//! which builds on the core, is held to the same rule.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Where a module names another: the file and line of each use.
type Edges = BTreeMap<String, BTreeMap<String, Vec<String>>>;

#[test]
fn no_top_level_module_imports_one_that_imports_it_back() {
    assert_no_cycles(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), 10);
}

#[test]
fn no_module_of_the_cache_crate_imports_one_that_imports_it_back() {
    assert_no_cycles(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../dmaload-share/src"), 3);
}

/// Fails naming each cycle between the top-level modules under `src`, at
/// least `modules` of which must be read.
fn assert_no_cycles(src: &Path, modules: usize) {
    let edges = module_edges(src);
    assert!(edges.len() >= modules, "too few modules read from {}: {:?}", src.display(), edges.keys());
    let cycles: Vec<Vec<String>> = strongly_connected(&edges).into_iter().filter(|c| c.len() > 1).collect();
    if cycles.is_empty() {
        return;
    }
    let mut report = String::new();
    for cycle in &cycles {
        report += &format!("\nmodules that import each other round: {}\n", cycle.join(", "));
        let members: BTreeSet<&String> = cycle.iter().collect();
        for from in cycle {
            for (to, places) in &edges[from] {
                if members.contains(to) {
                    report += &format!("  {from} -> {to}: {}\n", places.join(", "));
                }
            }
        }
    }
    panic!("import cycles between the top-level modules of {}:{report}", src.display());
}

#[test]
fn the_reader_sees_grouped_nested_and_inline_paths_and_skips_comments_and_tests() {
    let code = "use crate::a::B;\nuse crate::{b::{C, D}, c};\n// crate::hidden\n/* crate::hidden2 */\n\
                fn f() { crate::d::e(); let s = \"crate::in_string\"; }\n\
                #[cfg(test)]\nmod tests { use crate::test_only; fn g() { if true { } } }\n\
                fn h() -> crate::e::F { todo!() }\n";
    let names: BTreeSet<String> = crate_paths(code).into_iter().map(|(name, _)| name).collect();
    let expected: BTreeSet<String> = ["a", "b", "c", "d", "e"].into_iter().map(String::from).collect();
    assert_eq!(names, expected);
    let mut edges = Edges::new();
    for (from, to) in [("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")] {
        edges.entry(from.into()).or_default().insert(to.into(), vec![]);
        edges.entry(to.into()).or_default();
    }
    let cycles: Vec<_> = strongly_connected(&edges).into_iter().filter(|c| c.len() > 1).collect();
    assert_eq!(cycles, vec![vec!["x".to_string(), "y".into(), "z".into()]]);
}

/// For each top-level module (`src/NAME.rs` or `src/NAME/`), the other
/// top-level modules its code names through `crate::`.
fn module_edges(src: &Path) -> Edges {
    let mut edges = Edges::new();
    for entry in fs::read_dir(src).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).expect("utf-8 name").to_string();
        if name == "lib" {
            continue;
        }
        let files = if path.is_dir() { rust_files(&path) } else { vec![path.clone()] };
        let targets = edges.entry(name.clone()).or_default();
        for file in files {
            let text = fs::read_to_string(&file).expect("read source");
            let shown = file.strip_prefix(src).unwrap_or(&file).display().to_string();
            for (to, line) in crate_paths(&text) {
                if to != name {
                    targets.entry(to).or_default().push(format!("{shown}:{line}"));
                }
            }
        }
    }
    // Names that are not modules (a macro, a re-exported item at the root)
    // are no edges.
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    for targets in edges.values_mut() {
        targets.retain(|to, _| modules.contains(to));
    }
    edges
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The first segment after each `crate::` in code, with its line number:
/// `crate::a::B`, each member of `crate::{a, b::{C}}`, inline paths.
fn crate_paths(text: &str) -> Vec<(String, usize)> {
    let code = code_only(text);
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(found) = code[at..].find("crate::") {
        let start = at + found;
        at = start + "crate::".len();
        let word_before = start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if word_before {
            continue; // `$crate::`, `dmaload_crate::`
        }
        let line = code[..start].matches('\n').count() + 1;
        if bytes.get(at) == Some(&b'{') {
            for member in group_members(&code[at + 1..]) {
                out.push((member, line));
            }
        } else {
            out.push((identifier(&code[at..]), line));
        }
    }
    out.retain(|(name, _)| !name.is_empty() && name != "self");
    out
}

/// The first identifier of each comma-separated member of a `{…}` group
/// whose opening brace was just passed.
fn group_members(rest: &str) -> Vec<String> {
    let mut members = vec![identifier(rest.trim_start())];
    let mut depth = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => members.push(identifier(rest[i + 1..].trim_start())),
            _ => {}
        }
    }
    members
}

fn identifier(s: &str) -> String {
    s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
}

/// The text with comments, string literals and `#[cfg(test)]` items
/// blanked (newlines kept, so line numbers stay true).
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let rest: String = chars[i..chars.len().min(i + 12)].iter().collect();
        if rest.starts_with("//") {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if chars[i] == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                }
                i += 1;
            }
            i += 1;
        } else if chars[i] == 'r'
            && matches!(chars.get(i + 1), Some('"' | '#'))
            && !(i > 0 && (chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '_'))
        {
            // A raw string: r"…" or r#"…"#.
            let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            i += 2 + hashes;
            while i < chars.len() && !chars[i..].iter().collect::<String>().starts_with(&close) {
                out.push(blank(chars[i]));
                i += 1;
            }
            i += close.len();
        } else if chars[i] == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3; // a char literal such as '{'
        } else if chars[i] == '\'' && chars.get(i + 1) == Some(&'\\') {
            // An escaped char literal: '\n', '\'', '\u{…}'.
            i += 3;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if rest.starts_with("#[cfg(test)]") {
            // Skip the item: up to its `;` or its matching `}`.
            i += "#[cfg(test)]".len();
            let mut depth = 0;
            while i < chars.len() {
                let c = chars[i];
                out.push(blank(c));
                i += 1;
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ';' if depth == 0 => break,
                    _ => {}
                }
            }
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Tarjan's strongly connected components, each sorted, in a stable order.
fn strongly_connected(edges: &Edges) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges[v].keys() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            component.sort();
            s.out.push(component);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.out.sort();
    state.out
}
