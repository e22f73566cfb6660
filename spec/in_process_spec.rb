# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "open3"
require "json"

# The in-process side under abuse: a process recording itself while it forks, and while its
# threads retag without pause under GC.stress and GC.compact. Each case runs in a fresh Ruby
# so a crash or hang shows as that process's exit status, not as this suite dying.
RSpec.describe "in-process recording and tags under abuse" do
  before do
    skip "the extension is built for the host Ruby" unless RubySpyTest::TargetRuby.current.host?
  end

  # Runs +code+ in a fresh Ruby with lib/ on the load path; [stdout, stderr, status]. Killed
  # (and failed) if it takes longer than +timeout+.
  def run_ruby(code, timeout: 60)
    lib = File.join(RubySpyTest::ROOT, "lib")
    Open3.popen3(RbConfig.ruby, "-I", lib, "-rrbspy_ext", "-rjson", "-e", code) do |stdin, out, err, thread|
      stdin.close
      unless thread.join(timeout)
        Process.kill(:KILL, thread.pid)
        raise "ruby did not finish within #{timeout} s (a hang)"
      end
      [out.read, err.read, thread.value]
    end
  end

  it "a child forked while its parent records itself has no running sampler: running? is false, stop returns at once with a note" do
    out, err, status = run_ruby(<<~RUBY)
      recorder = RubySpy::Recorder.new(Process.pid, rate: 1000).start
      busy = ->(s) { t = Process.clock_gettime(Process::CLOCK_MONOTONIC) + s; x = 0; x += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < t }
      busy.(0.2)
      reader, writer = IO.pipe
      child = fork do
        reader.close
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        running = recorder.running?
        progress = recorder.progress
        profile = recorder.stop
        writer.write(JSON.generate(running: running, progress_samples: progress[:samples], samples: profile.samples,
                                   notes: profile.notes, seconds: Process.clock_gettime(Process::CLOCK_MONOTONIC) - started))
        writer.close
        GC.start # the recorder's native object may be freed in the child too
        exit!(0)
      end
      writer.close
      _, child_status = Process.wait2(child)
      busy.(0.2)
      parent = recorder.stop
      puts JSON.generate(child: JSON.parse(reader.read), child_exit: child_status.exitstatus,
                         parent_samples: parent.samples, parent_notes: parent.notes)
    RUBY
    expect(status.success?).to be(true), "exit #{status.inspect}\n#{err}"
    result = JSON.parse(out)
    expect(result["child_exit"]).to eq(0)
    expect(result["child"]).to include("running" => false, "samples" => 0)
    expect(result["child"]["notes"].join).to match(/forked from it: the sampler runs on in the parent only/)
    expect(result["child"]["seconds"]).to be < 1
    expect(result["parent_samples"]).to be > 200 # the parent's recording went on through the fork
  end

  it "8 threads retagging while the process records itself, under GC.stress then GC.compact: no crash, every tag read back as set" do
    out, err, status = run_ruby(<<~RUBY, timeout: 120)
      stop = false
      errors = []
      threads = Array.new(8) do |i|
        Thread.new do
          n = 0
          until stop
            RubySpy.tag(worker: i, round: n % 7, note: "w\#{i}") do
              got = RubySpy.tags
              errors << got unless got == { worker: i, round: n % 7, note: "w\#{i}" }
              Fiber.new { errors << :fiber unless RubySpy.tags[:worker] == i }.resume
            end
            n += 1
          end
          n
        end
      end
      profile = RubySpy.record(Process.pid, rate: 1000) do
        GC.stress = true
        sleep 1
        GC.stress = false
        5.times { GC.compact; sleep 0.05 }
      end
      stop = true
      rounds = threads.map(&:value)
      seen = profile.tags.map { |t| t[:tags] }.reject(&:empty?)
      puts JSON.generate(rounds: rounds, errors: errors.first(5).map(&:inspect), samples: profile.samples,
                         tag_sets: seen.size, bad_sets: seen.reject { |t| t[:note] == "w\#{t[:worker]}" && t[:round].to_i.between?(0, 6) }.first(5))
    RUBY
    expect(status.success?).to be(true), "exit #{status.inspect}\n#{err}"
    result = JSON.parse(out)
    expect(result["errors"]).to eq([])
    expect(result["rounds"]).to all(be > 0)
    expect(result["samples"]).to be > 100
    expect(result["tag_sets"]).to be > 0
    expect(result["bad_sets"]).to eq([])
  end
end
