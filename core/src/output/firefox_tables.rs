//! The tables of the [`super::firefox`] format that every thread shares (`profile.shared`):
//! strings, source files, functions, frames and stacks, each written as columns with its
//! length, as the processed format has them. Built as the profile's stacks are met, so a
//! function, frame or stack prefix that many threads share is written once.
use super::{FunctionKey, Interner};
use serde::Serialize;
use serde_json::{json, Value};

/// A table that the format writes as columns, with its length.
#[derive(Serialize, Default)]
struct Sources {
    length: usize,
    id: Vec<Option<u32>>,
    filename: Vec<u32>,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct FuncTable {
    length: usize,
    name: Vec<u32>,
    #[serde(rename = "isJS")]
    is_js: Vec<bool>,
    #[serde(rename = "relevantForJS")]
    relevant_for_js: Vec<bool>,
    resource: Vec<i32>,
    source: Vec<Option<u32>>,
    line_number: Vec<Option<u32>>,
    column_number: Vec<Option<u32>>,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct FrameTable {
    length: usize,
    address: Vec<i32>,
    inline_depth: Vec<u32>,
    category: Vec<u32>,
    subcategory: Vec<u32>,
    func: Vec<u32>,
    native_symbol: Vec<Option<u32>>,
    #[serde(rename = "innerWindowID")]
    inner_window_id: Vec<Option<u32>>,
    line: Vec<Option<u32>>,
    column: Vec<Option<u32>>,
}

#[derive(Serialize, Default)]
struct StackTable {
    length: usize,
    frame: Vec<u32>,
    prefix: Vec<Option<u32>>,
}

/// The tables every thread shares, built as the stacks are met.
#[derive(Default)]
pub(super) struct Tables {
    strings: Interner<String>,
    sources: Interner<u32>,
    funcs: Interner<(u32, Option<u32>, bool)>,
    frames: Interner<(u32, Option<u32>, u32, u32)>,
    stacks: Interner<(Option<u32>, u32)>,
}

impl Tables {
    pub(super) fn string(&mut self, s: &str) -> u32 {
        // Interner's key is owned; the lookup allocates only for strings met once.
        self.strings.id(s.to_string()) as u32
    }

    /// The frame of `label`/`path` (path empty: a C function or a leaf) at `line`, drawn in
    /// `category`.
    pub(super) fn frame(
        &mut self,
        key: FunctionKey,
        line: Option<u32>,
        category: (u32, u32),
    ) -> u32 {
        let name = self.string(key.label);
        let source = (!key.is_c()).then(|| {
            let file = self.string(key.path);
            self.sources.id(file) as u32
        });
        let is_ruby = !key.is_c();
        let func = self.funcs.id((name, source, is_ruby)) as u32;
        let line = if is_ruby { line } else { None };
        self.frames.id((func, line, category.0, category.1)) as u32
    }

    /// The stack of `frames` (root first) below `prefix`.
    pub(super) fn push(&mut self, prefix: Option<u32>, frame: u32) -> u32 {
        self.stacks.id((prefix, frame)) as u32
    }

    pub(super) fn shared(self) -> Shared {
        let mut sources = Sources::default();
        for &file in &self.sources.list {
            sources.id.push(None);
            sources.filename.push(file);
        }
        sources.length = self.sources.list.len();
        let mut funcs = FuncTable::default();
        for &(name, source, is_ruby) in &self.funcs.list {
            funcs.name.push(name);
            funcs.is_js.push(is_ruby);
            // C functions and leaves stay in views of Ruby frames only ("JavaScript" in the
            // profiler's words), as Firefox keeps DOM calls in its JS-only call tree.
            funcs.relevant_for_js.push(!is_ruby);
            funcs.resource.push(-1);
            funcs.source.push(source);
            funcs.line_number.push(None);
            funcs.column_number.push(None);
        }
        funcs.length = self.funcs.list.len();
        let mut frames = FrameTable::default();
        for &(func, line, category, subcategory) in &self.frames.list {
            frames.address.push(-1);
            frames.inline_depth.push(0);
            frames.category.push(category);
            frames.subcategory.push(subcategory);
            frames.func.push(func);
            frames.native_symbol.push(None);
            frames.inner_window_id.push(None);
            frames.line.push(line);
            frames.column.push(None);
        }
        frames.length = self.frames.list.len();
        let mut stacks = StackTable::default();
        for &(prefix, frame) in &self.stacks.list {
            stacks.prefix.push(prefix);
            stacks.frame.push(frame);
        }
        stacks.length = self.stacks.list.len();
        Shared {
            string_array: self.strings.list,
            sources,
            func_table: funcs,
            frame_table: frames,
            stack_table: stacks,
            resource_table: json!({"length": 0, "lib": [], "name": [], "host": [], "type": []}),
            native_symbols: json!({"length": 0, "libIndex": [], "address": [], "name": [], "functionSize": []}),
        }
    }
}

/// `profile.shared`: the tables every thread's samples and markers index.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Shared {
    string_array: Vec<String>,
    sources: Sources,
    func_table: FuncTable,
    frame_table: FrameTable,
    stack_table: StackTable,
    resource_table: Value,
    native_symbols: Value,
}
