# frozen_string_literal: true

require_relative "lib/rbspy_ext/version"

Gem::Specification.new do |spec|
  spec.name = "rbspy_ext"
  spec.version = RubySpy::VERSION
  spec.authors = ["rbspy_ext contributors"]
  spec.summary = "Snapshot the Ruby stack of another process by reading its memory"
  spec.description = "RubySpy.snapshot(pid) reads the call stack of a running Ruby process " \
                     "through /proc and process_vm_readv, without stopping it. Rust core, built " \
                     "with cargo at install time."
  spec.license = "MIT"
  spec.required_ruby_version = ">= 2.7"

  # Everything git knows about (tracked, or untracked but not ignored, so a tree that is not
  # committed yet still packs), limited to what `gem install` needs: the Ruby code, and the
  # whole cargo workspace with its Cargo.lock so the extension builds from the gem alone.
  # bindings/generator is excluded from the workspace and only run by hand.
  packed = %r{\A(?:lib|ext|core|bindings|exe)/|\A(?:Cargo\.toml|Cargo\.lock|README\.md|ARCHITECTURE\.md|LICENSE)\z}
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
