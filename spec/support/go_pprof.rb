# frozen_string_literal: true

require "open3"
require "tmpdir"

module RubySpyTest
  # Go's own pprof client (`go tool pprof`, the first go on PATH: golang-go's, or a newer Go's)
  # reading what a scraper would.
  module GoPprof
    # Where Go keeps the pprof it builds: a Go from 1.24 on ships no prebuilt pprof and
    # builds it at its first `go tool pprof` (seconds of CPU), then runs it from this cache.
    # script/setup builds it there once per machine.
    GOCACHE = File.join(ENV.fetch("RBSPY_EXT_CACHE") { File.join(Dir.home, ".cache", "rbspy_ext") }, "go-build")

    module_function

    # Runs `go tool pprof ARGS` with a private home (pprof keeps state there) and returns its
    # output; raises with that output when it fails.
    def go_pprof(*args)
      Dir.mktmpdir do |dir|
        env = { "PPROF_TMPDIR" => dir, "HOME" => dir, "GOCACHE" => GOCACHE }
        out, status = Open3.capture2e(env, "go", "tool", "pprof", *args)
        raise "go tool pprof #{args.join(' ')} failed:\n#{out}" unless status.success?

        out
      end
    end

    # The samples of `go tool pprof -traces` output, each as its labels, its value ("10ms",
    # or a count with -sample_index=samples) and its functions (innermost first). A sample is
    # a block between rules: "key:  value" label lines, then its value beside the first
    # function ("      10ms   Process.clock_gettime"), then one function a line.
    def traces(text)
      text.split(/^-+\+-+$/).drop(1).filter_map do |block|
        lines = block.lines.map(&:strip).reject(&:empty?)
        labels, functions = lines.partition { |line| line.match?(/\A\w[\w ]*:\s/) } # keys may hold spaces ("trace id")
        next if functions.empty?

        value, first = functions.first.split(/\s+/, 2)
        { labels: labels.to_h { |line| line.split(/:\s+/, 2) }, value: value, functions: [first, *functions.drop(1)] }
      end
    end
  end
end
