# frozen_string_literal: true

require "open3"
require "rbconfig"
require "shellwords"
require_relative "../paths"

module RubySpyTest
  # Running exe/rubyspy as its users do: a child process of the host Ruby, from the
  # repository root. Included into every example group (see spec_helper.rb). Without RubyGems,
  # which the CLI does not need and which costs a tenth of a second of CPU per run, some 120
  # runs per suite (issue 47); spec/gem_install_spec.rb runs the installed gem's own
  # executable, through RubyGems, as users start it.
  module CLIHelpers
    EXE = File.join(ROOT, "exe", "rubyspy")

    # A finished run of the CLI: what it printed and how it exited.
    CLIRun = Struct.new(:args, :env, :under, :stdout, :stderr, :status) do
      def exitstatus = status.exitstatus

      def success? = status.success?

      # The run as a failure message shows it: the command, its exit, stderr, then stdout
      # (cut short: a pprof written to stdout is binary and large). Read as UTF-8 whatever
      # binmode: gave, so that the parts join.
      def to_s
        shown = stdout.bytesize > 2000 ? "#{stdout.byteslice(0, 2000)}... (#{stdout.bytesize} bytes)" : stdout
        command = env.map { |k, v| "#{k}=#{v.to_s.shellescape} " }.join + [*under, "rubyspy", *args].shelljoin
        "#{command}\nexit: #{status.inspect}\nstderr: #{utf8(stderr)}\nstdout: #{utf8(shown)}"
      end

      private

      def utf8(bytes) = bytes.dup.force_encoding(Encoding::UTF_8).scrub
    end

    # The command line of `rubyspy ARGS`, for a spec that starts it itself (in the
    # background, in a terminal).
    def rubyspy_command(*args)
      [RbConfig.ruby, "--disable-gems", EXE, *args.map(&:to_s)]
    end

    # Runs `rubyspy ARGS` until it exits; a CLIRun. +under+ is a command that runs it
    # (["setpriv", ...], ["unshare", ...]); +options+ go to Open3.capture3 (stdin_data:,
    # binmode:).
    def rubyspy(*args, env: {}, under: [], chdir: ROOT, **options)
      args = args.map(&:to_s)
      out, err, status = Open3.capture3(env, *under, *rubyspy_command(*args), chdir: chdir, **options)
      CLIRun.new(args, env, under, out, err, status)
    end

    # #rubyspy, expecting it to exit with +exitstatus+: an example that goes on with the
    # output of a run that failed would fail further on, where the reason no longer shows.
    def rubyspy!(*args, exitstatus: 0, **options)
      run = rubyspy(*args, **options)
      expect(run.exitstatus).to eq(exitstatus), run.to_s
      run
    end
  end
end
