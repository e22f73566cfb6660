# frozen_string_literal: true

require_relative "../paths"
require_relative "../target"
require_relative "../target_ruby"

module RubySpyTest
  # Included into every example group (see spec_helper.rb). Targets started through these
  # helpers are killed and reaped after each example, pass or fail.
  module TargetHelpers
    def start_target(name, *args, stdio: false, env: {}, ruby: TargetRuby.current)
      target = Target.start(name, *args, stdio: stdio, env: env, ruby: ruby)
      running_targets << target
      target
    end

    # Several copies of the same fixture at once, each with its own ready file; spawned
    # together, then waited for.
    def start_targets(name, count, *args)
      targets = Array.new(count) { Target.new(name, *args) }
      targets.each do |t|
        running_targets << t
        t.spawn
      end
      targets.each(&:wait_until_ready)
      targets
    end

    # Runs the same fixture +times+ times one after another, yielding each running copy and
    # stopping it before the next starts.
    def each_run(name, *args, times:)
      times.times do |i|
        target = start_target(name, *args)
        begin
          yield target, i
        ensure
          target.stop
          running_targets.delete(target)
        end
      end
    end

    def with_target(name, *args, stdio: false)
      target = Target.start(name, *args, stdio: stdio)
      yield target
    ensure
      target&.stop
    end

    def stop_all_targets
      running_targets.each(&:stop)
      running_targets.clear
    end

    def running_targets
      @running_targets ||= []
    end

    # The line of the fixture carrying "# MARKER" (fixtures mark line ranges this way).
    def fixture_line(name, marker)
      path = File.join(FIXTURES, "#{name}.rb")
      index = File.readlines(path).index { |line| line.include?("# #{marker}") }
      raise "no '# #{marker}' in #{path}" unless index

      index + 1
    end
  end
end
