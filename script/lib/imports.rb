# frozen_string_literal: true

# Who imports whom among the project's Rust files, for script/check-circles and
# script/check-floors: the module tree of each crate from its lib.rs (`mod x;` is x.rs or
# x/mod.rs beside its parent), and each file's imports through `crate::` and `super::` paths
# (a `use` tree and inline paths alike). A module's own children and ancestors are tree
# edges, not imports: `use super::*` in spy/walker.rs reads spy/mod.rs, which declares it.
# Test code (`#[cfg(test)]` modules) and comments are left out.
require "set"

module Imports
  ROOT = File.expand_path("../..", __dir__)
  CRATES = %w[core/src ext/rbspy_ext/src bindings/src].freeze

  # One crate's module tree and import edges.
  class Crate
    # [module path] => file; file => Set of imported files; file => names it takes from the
    # crate root (`crate::Result`) where lib.rs only re-exports them; file => Set of the
    # ancestors it imports from (`super::Item` in spy/walker.rs reads spy/mod.rs).
    attr_reader :modules, :edges, :through_root, :up_edges

    def initialize(dir)
      @dir = dir
      @modules = {}
      @edges = Hash.new { |h, k| h[k] = Set.new }
      @through_root = Hash.new { |h, k| h[k] = [] }
      @up_edges = Hash.new { |h, k| h[k] = Set.new }
      walk([], "#{ROOT}/#{dir}/lib.rs")
      reexports = Imports.paths(Imports.code(@modules[[]]), uses_only: true, pub_only: true)
                         .map { |p| p.split("::").last }.to_set
      @modules.each { |path, file| find_edges(path, file, reexports) }
    end

    def files
      @modules.values
    end

    private

    def walk(path, file)
      @modules[path] = file
      Imports.code(file).scan(/\bmod\s+(\w+)\s*;/) do |(name)|
        dir = file.end_with?("lib.rs", "mod.rs") ? File.dirname(file) : file.delete_suffix(".rs")
        child = ["#{dir}/#{name}.rs", "#{dir}/#{name}/mod.rs"].find { |p| File.exist?(p) }
        walk(path + [name], child) if child
      end
    end

    def find_edges(path, file, reexports)
      children = @modules.keys.filter_map { |p| p.last if p.size == path.size + 1 && p[0...-1] == path }
      Imports.paths(Imports.code(file)).each do |named|
        segments = named.split("::")
        base = case segments[0]
               when "crate" then segments.shift && []
               when "super"
                 up = path.dup
                 (segments.shift; up.pop) while segments[0] == "super"
                 up
               else
                 next unless children.include?(segments[0]) # std::, serde::, other crates

                 path
               end
        full = base + segments
        target = full.size.downto(0).map { |n| full[0, n] }.find { |q| @modules[q] }
        # `crate::Result`: lib.rs's re-export, not error.rs (a `super::` in an inline module
        # may also read as the root, so only `crate::` counts).
        if named.start_with?("crate::") && full.size == 1 && reexports.include?(full[0]) && !path.empty?
          @through_root[file] << full[0]
        end
        next if target.nil? || target == path # itself
        # An ancestor: a tree edge, not an import, except to check-floors's floors inside a folder.
        next @up_edges[file] << @modules[target] if path[0, target.size] == target

        @edges[file] << @modules[target]
      end
    end
  end

  # A file's code without comments, strings (a serde `with = "crate::..."` path is kept as
  # code) or test modules.
  def self.code(path)
    src = File.read(path).gsub(/"((?:crate|super)(?:::\w+)+)"/, ' \1 ')
              .gsub(/"(\\.|[^"\\])*"/, '""').gsub(%r{//[^\n]*}, "")
    src.gsub(/#\[cfg\(test\)\]\s*(#\[[^\]]*\]\s*)*(pub(\(\w+\))?\s+)?mod\s+\w+\s*(;|(?<b>\{(?:[^{}]|\g<b>)*\}))/m, "")
  end

  # Every path a file names: `use a::{b, c::d}` gives a::b and a::c::d; inline crate::/super::
  # paths count too (unless `uses_only`). `pub_only`: only `pub use` trees (re-exports).
  def self.paths(src, uses_only: false, pub_only: false)
    pattern = pub_only ? /\bpub\s+use\s+([^;]+);/ : /\buse\s+([^;]+);/
    trees = src.scan(pattern).map { |(u)| u.gsub(/\s+/, "") }
    used = trees.flat_map { |t| expand(t) }
    uses_only ? used : used + src.scan(/\b((?:crate|super)(?:::\w+)+)/).flatten
  end

  # `a::{b, c::{d, e}}` → a::b, a::c::d, a::c::e.
  def self.expand(tree)
    return [tree] unless tree =~ /\A(.*?)::\{(.*)\}\z/

    prefix = Regexp.last_match(1)
    split_top(Regexp.last_match(2)).flat_map { |part| expand(part).map { |p| p == "self" ? prefix : "#{prefix}::#{p}" } }
  end

  # Splits `b, c::{d, e}` at its top-level commas.
  def self.split_top(list)
    parts = [+""]
    depth = 0
    list.each_char do |ch|
      depth += 1 if ch == "{"
      depth -= 1 if ch == "}"
      if ch == "," && depth.zero?
        parts << +""
      else
        parts.last << ch
      end
    end
    parts.reject(&:empty?)
  end

  def self.crates
    @crates ||= CRATES.to_h { |dir| [dir, Crate.new(dir)] }
  end

  def self.relative(file)
    file.delete_prefix("#{ROOT}/")
  end
end
