# frozen_string_literal: true

require "rbconfig"

# Builds through the same extconf.rb + Makefile that `gem install` runs, in tmp/, and
# installs into lib/ so `ruby -Ilib -e 'require "rbspy_ext"'` finds lib/rbspy_ext/rbspy_ext.so.
desc "Build the Rust extension into lib/rbspy_ext/rbspy_ext.so"
task :compile do
  root = File.expand_path("..", __dir__)
  build_dir = File.join(root, "tmp", RbConfig::CONFIG["arch"], "rbspy_ext", RUBY_VERSION)
  mkdir_p build_dir
  # A stub install (RBSPY_EXT_STUB=1) leaves this marker, which would hide a real build.
  rm_f File.join(root, "lib/rbspy_ext/unsupported_platform.rb")
  Dir.chdir(build_dir) do
    sh RbConfig.ruby, File.join(root, "ext/rbspy_ext/extconf.rb")
    # Overriding sitearchdir is what RubyGems does too; the Makefile adds /rbspy_ext.
    sh "make", "install", "sitearchdir=#{File.join(root, 'lib')}"
  end
end

desc "Remove the compiled extension and tmp/ (cargo's target/ is kept; see `cargo clean`)"
task :clean do
  rm_rf "tmp"
  rm_f Dir["lib/rbspy_ext/*.{so,bundle}", "lib/rbspy_ext/unsupported_platform.rb"]
end
