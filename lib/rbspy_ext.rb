# frozen_string_literal: true

require_relative "rbspy_ext/version"
require_relative "rbspy_ext/error"
require_relative "rbspy_ext/frame"

# The compiled extension defines RubySpy::NativeHandle (a live view of one process's Ruby VM),
# NativeRecorder and NativeProfile, which the Ruby classes of the same names without "Native"
# wrap, and the tag states; rbspy_ext/native.rb finds the one for this Ruby (or, where the spy
# cannot run, loads inert stand-ins).
require_relative "rbspy_ext/native"
RubySpy::Native.load!
require_relative "rbspy_ext/handle"
require_relative "rbspy_ext/census"
require_relative "rbspy_ext/allocations"
require_relative "rbspy_ext/recorder"
require_relative "rbspy_ext/profile"
require_relative "rbspy_ext/state"
require_relative "rbspy_ext/trace"
require_relative "rbspy_ext/server"
# The Rails integration tags requests and jobs by itself (rbspy_ext/rails.rb); Rack apps use
# RubySpy::Rack::Tags and RubySpy::Rack::Pprof (rbspy_ext/rack.rb), loaded on first use.
require_relative "rbspy_ext/rails" if defined?(Rails::Railtie)

# RubySpy reads the stack of a running Ruby process from its memory, without stopping or
# changing it. See README.md for the tour and ARCHITECTURE.md for how a snapshot is taken.
module RubySpy
  autoload :Rack, File.expand_path("rbspy_ext/rack", __dir__)
  autoload :OTel, File.expand_path("rbspy_ext/otel", __dir__)

  class << self
    # The stack of the thread that holds the GVL in process +pid+ (the main thread when no
    # thread holds it), innermost frame first, exactly as that thread's
    # +Thread#backtrace_locations+ would list it. Each Ractor has a GVL of its own: this is
    # the main Ractor's, whose threads are the only ones a process without Ractors has.
    #
    # With +threads: :all+, every Ruby thread of every Ractor instead, as
    # {Handle#thread_snapshots} gives them (like +py-spy dump+).
    #
    # @param pid [Integer] a process id; +Process.pid+ snapshots the calling process
    # @param threads [Symbol] +:gvl+ (the default) for the one stack, +:all+ for every thread
    # @return [Array<RubySpy::Frame>] the stack; with +threads: :all+ an Array of Hashes, one
    #   per thread (+:tid+, +:name+, +:main+, +:ractor+, +:ractor_name+, +:state+, +:frames+,
    #   +:tags+)
    # @raise [TypeError] if +pid+ is not an Integer
    # @raise [ArgumentError] if +pid+ is not positive, or +threads+ is neither +:gvl+ nor +:all+
    # @raise [RubySpy::Error] (a subclass naming the cause) when the process cannot be read
    # @example
    #   RubySpy.snapshot(worker_pid).each { |frame| puts frame }
    #   RubySpy.snapshot(worker_pid, threads: :all).each { |t| puts t[:name], t[:frames] }
    def snapshot(pid, threads: :gvl)
      unless %i[gvl all].include?(threads)
        raise ArgumentError, "threads: must be :gvl (the GVL holder's stack) or :all (every thread), got #{threads.inspect}"
      end

      handle = attach(pid)
      threads == :all ? handle.thread_snapshots : handle.snapshot
    end

    # Opens a reusable handle on process +pid+. The handle finds the Ruby VM once and caches
    # what cannot change (addresses, struct layout, method names, line tables), so repeated
    # snapshots through it cost a few memory reads each.
    #
    # @param pid [Integer]
    # @param force_version [String, nil] use this release's layout instead of the reported one
    # @return [RubySpy::Handle]
    # @raise (see .snapshot)
    def attach(pid, force_version: nil)
      Handle.new(pid, force_version: force_version)
    end

    # What fills process +pid+'s memory: its live objects by class and built-in type, with
    # the bytes of their slots and what strings, arrays and hashes hold outside them, read
    # from its GC's heap pages without stopping or changing it. +Process.pid+ counts the
    # calling process.
    #
    # With +sites: true+, a process that tracks allocations ({RubySpy.track_allocations},
    # +RUBYSPY_ALLOCATIONS=1+) also gives the code that allocated them: {Census#sites}.
    #
    # @param pid [Integer]
    # @param max_bytes [Integer, nil] see {Handle#heap}
    # @param sites [Boolean] see {Handle#heap}
    # @return [RubySpy::Census]
    # @raise (see .snapshot)
    # @example
    #   census = RubySpy.heap(worker_pid)
    #   census.classes.first(5).each { |c| puts "#{c[:objects]} #{c[:name]} (#{c[:bytes]} bytes)" }
    #   later = RubySpy.heap(worker_pid)
    #   (later - census).first # the class that grew most
    #   RubySpy.heap(worker_pid, sites: true).sites&.first # the top class and its sites
    def heap(pid, max_bytes: nil, sites: false)
      attach(pid).heap(max_bytes: max_bytes, sites: sites)
    end

    # How a thread's Ractor is named in views: "ractor 2", or "ractor 2 (name)" when it was
    # given a name.
    #
    # @param thread [Hash] a thread as {Handle#thread_snapshots} or {Profile#threads} list it
    # @return [String]
    def ractor_text(thread)
      "ractor #{thread[:ractor]}#{" (#{thread[:ractor_name]})" if thread[:ractor_name]}"
    end
  end
end

# RUBYSPY_PPROF=127.0.0.1:6060 opens a pprof listener of its own (RubySpy::Server) as soon as
# the gem is loaded, for processes started by a command line one cannot edit.
RubySpy::Server.start_from_env if ENV[RubySpy::Server::ENV_ADDRESS]

# RUBYSPY_ALLOCATIONS=1 tracks allocations from now on (RubySpy.track_allocations_from_env),
# which the listener and the Rack endpoint serve as /debug/pprof/allocs and /heap.
RubySpy.track_allocations_from_env if ENV[RubySpy::Allocations::ENV_ALLOCATIONS]

# With the OpenTelemetry API loaded first, every thread's and fiber's trace is published for
# readers outside (RubySpy::OTel); in Rails the Railtie does this after the initializers.
# RUBYSPY_OTEL=0 keeps it off.
RubySpy::OTel.install if defined?(OpenTelemetry::Context)
