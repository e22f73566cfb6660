//! callgrind.out (<https://valgrind.org/docs/manual/cl-format.html>), for callgrind_annotate
//! and KCachegrind/QCachegrind. One event, `Samples`; positions are source lines.
//!
//! Each function (`fl=` its path, `fn=` its label; C functions in [`C_FUNCTION_FILE`]) gets
//! its self cost at the lines where it was the innermost frame, and one `cfl=`/`cfn=`/`calls=`
//! block per (calling line, callee) with the samples that went through that call (its
//! inclusive cost). Threads merge, as in the other formats' defaults; a stack with no Ruby
//! frame costs [`NO_FRAMES`] in [`PSEUDO_FILE`], and so do the state leaves
//! (`[waiting for GVL]`, `[GC marking]`...) below the frames they stood in.
//!
//! Two liberties a sampling profiler has to take with a tracing format:
//! - `calls=` counts the samples seen in the call, not calls (which sampling cannot count);
//! - a call is recorded only at the callee's outermost appearance in a stack: recursive
//!   calls are left out, so a callee's inclusive cost (what callgrind_annotate --inclusive=yes
//!   sums from the calls into it) is exactly the samples it appears in, never counted twice.
use super::{stack_samples, FunctionKey, OutputError, C_FUNCTION_FILE, NO_FRAMES};
use crate::profile::Profile;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;

/// The file of the pseudo functions: [`NO_FRAMES`] (a stack with no Ruby frame) and the
/// state leaves (`[waiting for GVL]`...).
pub const PSEUDO_FILE: &str = "<threads>";

/// (file, function name): how callgrind tells functions apart.
type Function = (String, String);

#[derive(Default)]
struct Costs {
    /// Line → samples with this function innermost.
    self_cost: BTreeMap<i64, u64>,
    /// (calling line, callee) → the call.
    calls: BTreeMap<(i64, Function), Call>,
}

struct Call {
    samples: u64,
    /// Line of the callee where it was first seen (callgrind's call target position).
    target_line: i64,
}

pub fn write(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    let functions = costs(profile);
    writeln!(out, "# callgrind format")?;
    writeln!(out, "version: 1")?;
    writeln!(out, "creator: rbspy_ext {}", env!("CARGO_PKG_VERSION"))?;
    writeln!(out, "pid: {}", profile.pid)?;
    writeln!(
        out,
        "cmd: Ruby {} (pid {})",
        profile.ruby_version, profile.pid
    )?;
    writeln!(
        out,
        "desc: Sampled at {} Hz for {:.2} s",
        profile.rate_hz,
        profile.duration_ns as f64 / 1e9
    )?;
    writeln!(out, "positions: line")?;
    writeln!(out, "events: Samples")?;
    writeln!(out, "summary: {}", stack_samples(profile))?;

    // Name compression: "(id) name" the first time, "(id)" after. Files and functions have
    // separate id spaces.
    let mut names = Names::default();
    for (function, costs) in &functions {
        let (file, name) = function;
        writeln!(out)?;
        writeln!(out, "fl={}", names.file(file))?;
        writeln!(out, "fn={}", names.function(name))?;
        for (line, samples) in &costs.self_cost {
            writeln!(out, "{line} {samples}")?;
        }
        for ((line, (callee_file, callee_name)), call) in &costs.calls {
            writeln!(out, "cfl={}", names.file(callee_file))?;
            writeln!(out, "cfn={}", names.function(callee_name))?;
            writeln!(out, "calls={} {}", call.samples, call.target_line)?;
            writeln!(out, "{line} {}", call.samples)?;
        }
    }
    Ok(())
}

/// Each function's self cost by line and its calls by (line, callee), from every stack.
fn costs(profile: &Profile) -> BTreeMap<Function, Costs> {
    // A frame as callgrind sees it: its function and its line.
    let frames: Vec<(Function, i64)> = profile
        .frames
        .iter()
        .map(|f| {
            let key = FunctionKey::of(f);
            if key.is_leaf() {
                ((PSEUDO_FILE.to_string(), clean(key.label)), 0)
            } else if key.is_c() {
                ((C_FUNCTION_FILE.to_string(), clean(key.label)), 0)
            } else {
                ((clean(key.path), clean(key.label)), f.lineno as i64)
            }
        })
        .collect();
    let pseudo = |name: &str| ((PSEUDO_FILE.to_string(), clean(name)), 0i64);

    let mut functions: BTreeMap<Function, Costs> = BTreeMap::new();
    let mut stack: Vec<(Function, i64)> = Vec::new();
    for s in &profile.stacks {
        stack.clear();
        stack.extend(s.frames.iter().rev().map(|&f| frames[f as usize].clone()));
        if stack.is_empty() {
            stack.push(pseudo(NO_FRAMES));
        }
        let (leaf, leaf_line) = stack.last().expect("not empty");
        *functions
            .entry(leaf.clone())
            .or_default()
            .self_cost
            .entry(*leaf_line)
            .or_default() += s.count;
        let mut seen: HashSet<&Function> = HashSet::from([&stack[0].0]);
        for pair in stack.windows(2) {
            let [(caller, caller_line), (callee, callee_line)] = pair else {
                unreachable!()
            };
            if !seen.insert(callee) {
                continue; // recursion: see the module docs
            }
            functions
                .entry(caller.clone())
                .or_default()
                .calls
                .entry((*caller_line, callee.clone()))
                .or_insert(Call {
                    samples: 0,
                    target_line: *callee_line,
                })
                .samples += s.count;
        }
    }
    functions
}

#[derive(Default)]
struct Names {
    files: HashMap<String, usize>,
    functions: HashMap<String, usize>,
}

impl Names {
    fn file(&mut self, name: &str) -> String {
        Self::compress(&mut self.files, name)
    }

    fn function(&mut self, name: &str) -> String {
        Self::compress(&mut self.functions, name)
    }

    fn compress(ids: &mut HashMap<String, usize>, name: &str) -> String {
        match ids.get(name) {
            Some(id) => format!("({id})"),
            None => {
                let id = ids.len() + 1;
                ids.insert(name.to_string(), id);
                format!("({id}) {name}")
            }
        }
    }
}

/// A name runs to the end of its line.
fn clean(name: &str) -> String {
    name.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use crate::output::{fixture, write, Format, Options};
    use std::collections::HashMap;

    fn callgrind(options: &Options) -> String {
        let mut out = Vec::new();
        write(&fixture::profile(), Format::Callgrind, &mut out, options).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// A minimal reader of what we write: (file:function) → self cost, and inclusive cost as
    /// callgrind_annotate computes it (sum of the calls into a function; self plus outgoing
    /// calls for a function nobody calls).
    fn costs(text: &str) -> (HashMap<String, u64>, HashMap<String, u64>, u64) {
        let mut file_names = HashMap::new();
        let mut fn_names = HashMap::new();
        let uncompress = |map: &mut HashMap<String, String>, s: &str| {
            let (id, name) = s[1..].split_once(')').unwrap();
            let name = name.trim();
            if !name.is_empty() {
                map.insert(id.to_string(), name.to_string());
            }
            map[id].clone()
        };
        let (mut file, mut func, mut cfile) = (String::new(), String::new(), String::new());
        let mut callee = None;
        let mut self_cost: HashMap<String, u64> = HashMap::new();
        let mut outgoing: HashMap<String, u64> = HashMap::new();
        let mut incoming: HashMap<String, u64> = HashMap::new();
        let mut summary = 0;
        for line in text
            .lines()
            .skip_while(|l| !l.starts_with("events:"))
            .skip(1)
        {
            if let Some(v) = line.strip_prefix("summary: ") {
                summary = v.parse().unwrap();
            } else if let Some(v) = line.strip_prefix("fl=") {
                file = uncompress(&mut file_names, v);
            } else if let Some(v) = line.strip_prefix("fn=") {
                func = format!("{file}:{}", uncompress(&mut fn_names, v));
            } else if let Some(v) = line.strip_prefix("cfl=") {
                cfile = uncompress(&mut file_names, v);
            } else if let Some(v) = line.strip_prefix("cfn=") {
                callee = Some(format!("{cfile}:{}", uncompress(&mut fn_names, v)));
            } else if line.starts_with("calls=") {
                assert!(callee.is_some());
            } else if line.is_empty() {
            } else {
                let (_, cost) = line.split_once(' ').unwrap();
                let cost: u64 = cost.parse().unwrap();
                match callee.take() {
                    Some(c) => {
                        *incoming.entry(c).or_default() += cost;
                        *outgoing.entry(func.clone()).or_default() += cost;
                    }
                    None => *self_cost.entry(func.clone()).or_default() += cost,
                }
            }
        }
        let mut inclusive = incoming.clone();
        for f in self_cost.keys().chain(outgoing.keys()) {
            if !incoming.contains_key(f) {
                inclusive.insert(
                    f.clone(),
                    self_cost.get(f).copied().unwrap_or(0) + outgoing.get(f).copied().unwrap_or(0),
                );
            }
        }
        (self_cost, inclusive, summary)
    }

    #[test]
    fn output_callgrind_costs_add_up() {
        let p = fixture::profile();
        let text = callgrind(&Options::default());
        assert!(text.starts_with("# callgrind format\nversion: 1\n"));
        let (self_cost, inclusive, summary) = costs(&text);
        assert_eq!(summary, p.samples);
        assert_eq!(self_cost.values().sum::<u64>(), p.samples);
        assert_eq!(self_cost["<C function>:Kernel#sleep"], 7);
        assert_eq!(self_cost["<threads>:[no Ruby frames]"], 1);
        // Inclusive: the samples each function appears in, recursion counted once.
        assert_eq!(inclusive["app.rb:<main>"], 31);
        assert_eq!(inclusive["lib/fib.rb:Object#fib"], 7);
        assert_eq!(inclusive["lib/work.rb:Object#work"], 21);
        assert_eq!(inclusive["lib/work.rb:block in Object#work"], 4);
        // Threads merge: no thread is a function.
        assert!(!text.contains("Thread 4242"));
    }

    #[test]
    fn output_callgrind_takes_no_view_options() {
        let per_thread = Options {
            per_thread: true,
            ..Options::default()
        };
        let err = write(
            &fixture::profile(),
            Format::Callgrind,
            &mut Vec::new(),
            &per_thread,
        );
        let msg = err.unwrap_err().to_string();
        assert!(
            msg.contains("--per-thread") && msg.contains("flamegraph, speedscope and collapsed")
        );
    }

    /// callgrind_annotate (valgrind's) must read the file without a warning, and report the
    /// same totals.
    #[test]
    fn output_callgrind_parsed_by_callgrind_annotate() {
        let Some(tool) = [
            "/usr/bin/callgrind_annotate",
            "/usr/local/bin/callgrind_annotate",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .map(String::from)
        .or_else(|| {
            std::process::Command::new("callgrind_annotate")
                .arg("--version")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|_| "callgrind_annotate".to_string())
        }) else {
            eprintln!(
                "callgrind_annotate not installed: skipping its check of the callgrind output"
            );
            return;
        };
        let dir = std::env::temp_dir().join(format!("rbspy_ext_callgrind_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("callgrind.out.4242");
        std::fs::write(&file, callgrind(&Options::default())).unwrap();
        for inclusive in ["no", "yes"] {
            let out = std::process::Command::new(&tool)
                .arg(format!("--inclusive={inclusive}"))
                .arg("--threshold=100")
                .arg(&file)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{tool} failed:\n{stderr}\n{stdout}");
            assert!(!stderr.contains("WARNING"), "{tool} warned:\n{stderr}");
            // The summary line ("32  PROGRAM TOTALS", commified or not) and per-function rows.
            assert!(
                stdout.contains("32") && stdout.contains("PROGRAM TOTALS"),
                "{stdout}"
            );
            if inclusive == "yes" {
                assert!(
                    stdout
                        .lines()
                        .any(|l| l.contains("31") && l.contains("app.rb:<main>")),
                    "{stdout}"
                );
            } else {
                assert!(
                    stdout
                        .lines()
                        .any(|l| l.contains(" 7") && l.contains("<C function>:Kernel#sleep")),
                    "{stdout}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
