# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"
require "zlib"
require "json"

# Tags read from outside a process, through its memory only (spec/state_spec.rb covers the
# API inside the process). The target loads rbspy_ext itself, so these run on the host Ruby
# and on the script/rubies Rubies that have the extension built for them (script/rubies ext).
RSpec.describe "tags read from outside" do
  include RubySpyTest::Recording

  before do
    ruby = RubySpyTest::TargetRuby.current
    skip "no rbspy_ext built for #{ruby}: run script/rubies ext #{ruby.name}" unless ruby.extension?
  end

  def expected(target, key)
    target.info.fetch(key).transform_keys(&:to_sym)
  end

  it "RubySpy.snapshot returns the parked thread's frames with its fiber's tags, as text" do
    target = start_target("tagged")
    stack = RubySpy.snapshot(target.pid)
    expect(stack.tags).to eq(expected(target, "tags"))
    expect(stack.tags).to include(request_id: "req-#{target.pid}", user: "7", endpoint: "orders#show",
                                  ratio: "1.5", admin: "false", note: "nil", owner: "Request")
    expect(stack.map(&:label)).to include(a_string_matching(/handle/))
  end

  it "reads every thread's own tags, including a thread parked inside a fiber" do
    target = start_target("tagged")
    threads = RubySpy.attach(target.pid).thread_snapshots
    main = threads.find { |t| t[:main] }
    worker = threads.find { |t| t[:name] == "tagged-worker" }
    expect(main[:tags]).to eq(expected(target, "tags"))
    expect(worker[:tags]).to eq(expected(target, "worker_tags"))
    expect(worker[:tags]).to eq(job: "nightly-report", attempt: "3")
  end

  it "rubyspy tags prints each thread's tags and the published offset" do
    target = start_target("tagged")
    out = rubyspy!("tags", "--pid", target.pid).stdout
    expect(out).to match(/^ruby_profiler_state_tp_offset: -?\d+/)
    expect(out).to match(/main: request_id=req-#{target.pid} user=7 /)
    expect(out).to match(/\(tagged-worker\): job=nightly-report attempt=3$/)
  end

  it "never reports tags that were not set, while tables are replaced under the reader" do
    target = start_target("tag_churn")
    valid = target.info.fetch("sets").map { |set| set.to_h { |k, v| [k.to_sym, v.to_s] } } + [{}]
    profile = RubySpy::Recorder.new(target.pid, rate: 2000, duration: 1).start.wait.stop
    seen = profile.tags.map { |t| t[:tags] }
    expect(seen - valid).to eq([]), "tag sets never set: #{(seen - valid).inspect}"
    expect(seen & valid[0..2]).not_to be_empty
    expect(profile.samples).to be > 500
  end

  it "reads each short-lived thread's own tags, though a dead thread's memory is reused by the next" do
    target = start_target("thread_succession")
    profile = RubySpy::Recorder.new(target.pid, rate: 999, duration: 2).start.wait.stop
    by_slot = Hash.new { |h, k| h[k] = Hash.new(0) }
    profile.group_by(:slot).each do |slot, part|
      part.stacks.each do |stack|
        work = stack[:frames].find { |f| f.base_label.match?(/\Awork_\d\z/) }
        by_slot[work.base_label][slot] += stack[:samples] if work
      end
    end
    # Each thread lives ~20 ms (two share the GVL), a fifth of the 100 ms the recorder
    # trusts its thread list for; a GVL held by a thread the list does not have makes the
    # next sample read the list again, so nearly every tick finds a thread in work_K (about
    # 1,900 of 2,000 here, against 100 to 400 when only the 100 ms readings found them).
    main = profile.threads.index { |t| t[:main] }
    main_samples = profile.stacks.select { |s| s[:thread] == main }.sum { |s| s[:samples] }
    expect(by_slot.values.sum { |h| h.values.sum }).to be > main_samples / 2
    # Never another thread's tag. A sample whose tags could not be read (nil) is a loss, not a
    # wrong answer: 1 of 246 in work_2, once, in a clean-clone CI on a fresh machine (cause not
    # found yet); at most 1 % of a work_K's samples may be such.
    by_slot.each do |work, slots|
      expect(slots.keys - [nil]).to eq([work[/\d/]]), "samples in #{work} by their slot tag: #{slots}"
      expect(slots.fetch(nil, 0)).to be <= slots.values.sum / 100, "samples in #{work} by their slot tag: #{slots}"
    end
  end

  it "rubyspy record --by-tag roots collapsed stacks at each value of the tag" do
    target = start_target("tagged")
    Dir.mktmpdir do |dir|
      out_path = File.join(dir, "by-job.txt")
      rubyspy!("record", "--pid", target.pid, "--duration", 0.5, "--rate", 200, "--format", "collapsed",
               "--by-tag", "job", "--output", out_path)
      lines = File.readlines(out_path)
      expect(lines).to all(match(/\Ajob=(nightly-report|-);/))
      expect(lines.map { |l| l[/\Ajob=[^;]*/] }.uniq).to contain_exactly("job=nightly-report", "job=-")
    end
  end

  it "reads tags that do not change within each sample's one process_vm_readv" do
    target = start_target("tagged")
    profile = RubySpy::Recorder.new(target.pid, rate: 500, duration: 1).start.wait.stop
    threads = profile.threads.size
    expect(threads).to eq(2)
    expect(profile.tags.map { |t| t[:tags] }).to include(expected(target, "tags"), expected(target, "worker_tags"))
    # Reading each thread's table apart took 6 to 7 calls per thread per sample.
    per_thread = profile.cost[:read_calls].to_f / profile.ticks / threads
    expect(per_thread).to be < 1.5, "#{profile.cost} ticks=#{profile.ticks} errors=#{profile.errors} notes=#{profile.notes}"
  end

  it "notices a String tag changed in place within the time it trusts a decoded table" do
    target = start_target("tag_mutates")
    recorder = RubySpy::Recorder.new(target.pid, rate: 500, duration: 5).start
    sleep 0.3
    File.write("#{target.ready_path}.go", "")
    expect(target.result(".changed")).to eq("status" => "finished")
    sleep 0.5
    statuses = recorder.stop.tags.map { |t| t[:tags][:status] }
    expect(statuses).to include("starting", "finished")
  end

  it "reports no tags for a process that never loaded rbspy_ext" do
    target = start_target("nested_methods")
    expect(RubySpy.snapshot(target.pid).tags).to eq({})
  end

  it "attaches the sampled thread's tags to every sample, for select, group_by, pprof and collapsed" do
    target = start_target("tagged")
    profile = RubySpy::Recorder.new(target.pid, rate: 200, duration: 0.5).start.wait.stop
    sets = profile.tags.map { |t| t[:tags] }
    expect(sets).to include(expected(target, "tags"), expected(target, "worker_tags"))
    expect(profile.tags.sum { |t| t[:samples] }).to eq(profile.samples)

    mine = profile.select(request_id: "req-#{target.pid}", user: 7)
    expect(mine.samples).to be > 0
    expect(mine.threads.map { |t| t[:main] }.uniq).to eq([true])
    by_job = profile.group_by(:job)
    expect(by_job.keys).to contain_exactly(nil, "nightly-report")
    expect(by_job["nightly-report"].threads.map { |t| t[:name] }.uniq).to eq(["tagged-worker"])
    expect(by_job.values.sum(&:samples)).to eq(profile.samples)

    collapsed = profile.render(:collapsed, tag: :job)
    expect(collapsed.lines).to all(match(/\Ajob=(nightly-report|-);/))
    expect(collapsed).to include("job=nightly-report;")

    doc = JSON.parse(profile.render(:speedscope, tag: :job))
    names = doc["profiles"].map { |p| p["name"] }
    expect(names).to contain_exactly("job=nightly-report", "job=-")
    expect(doc["profiles"].map { |p| p["samples"].size }).to all(be > 0)

    Dir.mktmpdir do |dir|
      raw = profile.write(File.join(dir, "p.raw"), format: :raw)
      expect(RubySpy::Profile.load(raw).tags).to eq(profile.tags)
      path = profile.write(File.join(dir, "p.pb.gz"), format: :pprof)
      labels = pprof_labels(path)
      expect(labels).to include(["request_id", "req-#{target.pid}"], ["job", "nightly-report"])
    end
  end
end
