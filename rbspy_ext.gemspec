# frozen_string_literal: true

require_relative "lib/rbspy_ext/version"

Gem::Specification.new do |spec|
  spec.name = "rbspy_ext"
  spec.version = RubySpy::VERSION
  spec.authors = ["rbspy_ext contributors"]
  spec.summary = "See what a running Ruby process is doing, from outside: stacks, profiles, heap"
  spec.description = "Reads another Ruby process's memory through /proc and process_vm_readv, " \
                     "without stopping it: stack snapshots (RubySpy.snapshot), sampling profiles " \
                     "of every thread in flamegraph, speedscope, pprof and other formats, a pprof " \
                     "listener for fleet profilers, heap censuses by class, sampled allocation " \
                     "sites, and RSpec and Minitest integration. Rust core, built with cargo at " \
                     "install time."
  spec.license = "MIT"
  spec.required_ruby_version = ">= 2.7"

  # Everything git knows about (tracked, or untracked but not ignored, so a tree that is not
  # committed yet still packs), limited to what `gem install` needs: the Ruby code, and the
  # whole cargo workspace with its Cargo.lock so the extension builds from the gem alone, and
  # the guides the README links to. bindings/generator is excluded from the workspace and only
  # run by hand.
  packed = %r{\A(?:lib|ext|core|bindings|exe)/|\Adocs/[^/]+\.md\z|
              \A(?:Cargo\.toml|Cargo\.lock|README\.md|ARCHITECTURE\.md|CHANGELOG\.md|LICENSE)\z}x
  spec.files = Dir.chdir(__dir__) do
    `git ls-files -z --cached --others --exclude-standard`.split("\x0").uniq.select do |f|
      f.match?(packed) && !f.start_with?("bindings/generator/") && File.file?(f)
    end.sort
  end
  spec.bindir = "exe"
  spec.executables = spec.files.grep(%r{\Aexe/}).map { |f| File.basename(f) }
  spec.require_paths = ["lib"]
  spec.extensions = ["ext/rbspy_ext/extconf.rb"]
end
