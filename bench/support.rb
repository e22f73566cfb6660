# frozen_string_literal: true

# Shared by the benchmarks: where rbspy (the tool compared against) comes from.

# The rbspy binary: $RBSPY, or one installed from crates.io into the cache on first use.
def rbspy_binary
  from_env = ENV["RBSPY"]
  return from_env if from_env && File.executable?(from_env)

  root = File.join(ENV.fetch("XDG_CACHE_HOME", File.join(Dir.home, ".cache")), "rbspy_ext", "rbspy")
  bin = File.join(root, "bin", "rbspy")
  unless File.executable?(bin)
    warn "installing rbspy from crates.io into #{root} (one time, a few minutes)"
    system("cargo", "install", "--quiet", "rbspy", "--root", root) or abort "cargo install rbspy failed"
  end
  bin
end

