# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"

# Ractors (Ruby 3.0+) against real processes: each Ractor keeps its own list of threads and
# its own GVL, so a reader that follows only the main Ractor's sees an idle process while two
# cores burn. Every thread of every Ractor must be listed, sampled, stated by its own
# Ractor's GVL, named with its Ractor, and tagged; its stack must equal the thread's own
# backtrace_locations, taken inside its Ractor. The matrix in script/test runs this against
# every Ruby with Ractors, inside and outside the chroots; on 3.3 and later every example runs
# once more with RUBY_MN_THREADS=1 (non-main Ractors are M:N-scheduled there in any case).
RSpec.describe "Ractors" do
  include RubySpyTest::Recording

  target_ruby = RubySpyTest::TargetRuby.current
  # Eight shared native threads, 3.3's and 4.0's default, whatever the machine: 4.1-dev
  # defaults to one per CPU, and on two CPUs two Ractors that never block starve every other
  # Ractor (and, under RUBY_MN_THREADS=1, the main thread), which then never starts or
  # announces. Ruby's scheduler, not ours; earlier Rubies ignore the variable.
  threads_env = { "RUBY_MAX_CPU" => "8" }
  variants = [threads_env]
  variants << threads_env.merge("RUBY_MN_THREADS" => "1") if target_ruby.version >= Gem::Version.new("3.3")

  before do
    skip "Ractors need Ruby 3.0+ (target: #{target_ruby}, #{target_ruby.version})" if target_ruby.version < Gem::Version.new("3.0")
  end

  def expected_frames(frames)
    frames.map do |f|
      RubySpyTest::ExpectedFrame.new(label: f.fetch("label"), base_label: f.fetch("base_label"), path: f.fetch("path"),
                                     absolute_path: f["absolute_path"], lineno: f.fetch("lineno"))
    end
  end

  # The target's threads once +count+ of them are listed (a Ractor's watcher thread ends just
  # after it writes the ground truth).
  def settled_threads(handle, count)
    threads = nil
    # After 10 s, the threads listed then: the examples' own expectations judge them.
    wait_for("#{count} threads", timeout: 10, interval: 0.05, raise_on_timeout: false) do
      (threads = handle.thread_snapshots).size == count
    end
    threads
  end

  def record(pid, **options)
    RubySpy::Recorder.new(pid, **{ rate: 199, duration: 1.5 }.merge(options)).start.wait.stop
  end

  # Samples in which a thread held its Ractor's GVL (running, or collecting garbage for it).
  def on_cpu(thread)
    thread[:states].sum { |state, n| state == "running" || state.start_with?("gc") ? n : 0 }
  end

  variants.each do |env|
    context(env.key?("RUBY_MN_THREADS") ? "with RUBY_MN_THREADS=1" : "with the default scheduler") do
      it "lists every Ractor's threads, each stack equal to its own backtrace_locations" do
        target = start_target("ractors_parked", env: env)
        threads = settled_threads(RubySpy.attach(target.pid), 4)
        expect(threads.size).to eq(4), threads.map { |t| t.except(:frames) }.inspect

        main = threads.find { |t| t[:main] }
        expect(main).to include(ractor: 1, ractor_name: nil, state: "blocked")
        expect(main[:frames]).to match_backtrace(target.frames, ruby_version: target.ruby_version)

        target.info.fetch("ractors").each do |r|
          thread = threads.find { |t| t[:ractor_name] == r.fetch("name") }
          expect(thread).not_to be_nil, "no thread of Ractor #{r['name']} in #{threads.map { |t| t.except(:frames) }}"
          expect(thread).to include(name: r.fetch("thread_name"), main: false, state: "blocked")
          expect(thread[:ractor]).to be > 1
          expect(thread[:frames]).to match_backtrace(expected_frames(r.fetch("frames")), ruby_version: target.ruby_version)
          # A 1:1 thread keeps its native thread; an M:N one asleep holds none (tid 0).
          if target_ruby.version < Gem::Version.new("3.3")
            expect(thread[:tid]).to eq(r.fetch("tid"))
          else
            expect([0, r.fetch("tid")]).to include(thread[:tid])
          end
        end
        expect(threads.map { |t| t[:ractor] }.uniq.size).to eq(4)
        # The one stack is still the main Ractor's choice: nobody holds its GVL, so the main
        # thread's.
        expect(RubySpy.snapshot(target.pid)).to match_backtrace(target.frames, ruby_version: target.ruby_version)
      end

      it "records two Ractors spinning at once as two running threads, each in its own code" do
        target = start_target("ractor_spinners", env: env)
        profile = record(target.pid)
        spinners = profile.threads.select { |t| t[:ractor] > 1 }
        expect(spinners.map { |t| [t[:ractor_name], t[:name]] }.sort)
          .to eq([%w[spin-a spinner-a], %w[spin-b spinner-b]])
        tids = target.info.fetch("ractors").to_h { |r| [r.fetch("name"), r.fetch("tid")] }
        spinners.each do |t|
          total = t[:states].values.sum
          expect(total).to be > 100
          expect(on_cpu(t)).to be >= 0.9 * total, "#{t[:name]}: #{t[:states]}"
          expect(t[:tid]).to eq(tids.fetch(t[:ractor_name]))
        end
        main = profile.threads.find { |t| t[:main] }
        expect(main[:states].keys).to eq(["blocked"])

        # Each spinner's samples are of its own method, and views name its Ractor.
        stacks = parse_collapsed(profile.render(:collapsed, per_thread: true))
        %w[a b].each do |x|
          own = stacks.select { |stack, _| stack.include?("(spinner-#{x}) in ractor ") }
          expect(own).not_to be_empty
          expect(own.sum { |stack, n| stack.include?("Spinners.spin_#{x}") ? n : 0 }).to be >= 0.9 * own.sum { |_, n| n }
          expect(own.map(&:first).grep(/spin_#{x == 'a' ? 'b' : 'a'}/)).to be_empty
        end

        Dir.mktmpdir do |dir|
          labels = pprof_labels(profile.write(File.join(dir, "ractors.pb.gz"), format: :pprof))
          spinners.each do |t|
            expect(labels).to include(["ractor", t[:ractor].to_s], ["ractor_name", t[:ractor_name]])
          end
          expect(labels).to include(%w[ractor 1])
        end
        # The one stack stays the main Ractor's: its GVL is free, so the main thread's.
        expect(RubySpy.snapshot(target.pid)).to match_backtrace(target.frames, ruby_version: target.ruby_version)
        # The CLI names each thread's Ractor.
        out = rubyspy("snapshot", "--pid", target.pid, "--threads", "all").stdout
        spinners.each do |t|
          expect(out).to match(/^Thread #{t[:tid]} \(#{t[:name]}\) in ractor #{t[:ractor]} \(#{t[:ractor_name]}\): running$/)
        end
      end

      it "samples the spinning Ractors in the kernel too, each by its own GVL" do
        skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?

        target = start_target("ractor_spinners", env: env)
        # The kernel samples a thread only while it is on a CPU: about 0.4 s of two spinners
        # on an idle machine, longer when they share the CPUs with other work.
        profile = record_until_samples(target.pid, samples: 400, mode: :bpf, rate: 499)
        spinners = profile.threads.select { |t| t[:ractor] > 1 }
        expect(spinners.map { |t| t[:ractor_name] }.sort).to eq(%w[spin-a spin-b])
        spinners.each do |t|
          # Under one process-wide GVL reading, the second spinner would be "no_gvl".
          expect(on_cpu(t)).to be >= 0.9 * t[:states].values.sum, "#{t[:name]}: #{t[:states]}"
          # Each spinner has its share. Not half each: with other work on the machine the
          # scheduler is not even, and one had 106 of 455 (23 %, sid inside, CI's two lanes).
          expect(t[:states].values.sum).to be >= 0.1 * profile.samples, profile.threads.inspect
        end
      end
    end
  end

  describe "tags" do
    before do
      skip "no rbspy_ext built for #{target_ruby}: run script/rubies ext #{target_ruby.name}" unless target_ruby.extension?
    end

    # Four Ractors tag their work apart (job: rN around Taggers.burn_N), in threads and in
    # fibers (4.0+), while GC.stress collects at almost every allocation: each tag read from
    # outside must come with its own Ractor's thread and frames.
    # Quiet: beside another run a Ractor's share of its own tag fell short in CI's lanes.
    it "reads each Ractor's own tags under GC.stress, none wrong", quiet: true do
      target = start_target("ractor_tags", env: threads_env.merge("GC_STRESS" => "1"))
      target.info.fetch("ractors").each do |r|
        expect(r).to include("tags_ok" => true, "published" => true)
      end
      expect(target.info["gc_stress"]).to be(true)
      profile = record(target.pid, rate: 499, duration: 2)
      groups = profile.group_by(:job)
      expect(groups.keys.compact.sort).to eq(%w[r0 r1 r2 r3])
      wrong = 0
      groups.each do |job, group|
        next if job.nil?

        index = job.delete_prefix("r")
        expect(group.samples).to be > 20, "#{job}: #{group.samples} samples"
        threads = group.threads.map { |t| [t[:name], t[:ractor_name]] }.uniq
        expect(threads).to eq([["tagger-#{index}", "tag-#{index}"]])
        group.stacks.each do |stack|
          labels = stack[:frames].map(&:label)
          # Ruby code of another Ractor's job under this tag would be a wrong tag; a sample
          # between two blocks (the loop itself, a fiber starting) names no burn at all.
          wrong += stack[:samples] if labels.any? { |l| l =~ /Taggers\.burn_(\d)\z/ && Regexp.last_match(1) != index }
        end
        # Most of a tag's samples are its own burn. Not all: under GC.stress the tag block's
        # own allocations each run a GC, and with another process on the other core the share
        # fell to 49 % (212 of 431, sid inside, CI's two lanes), so the floor is 40 %. Which
        # Ractor a tag belongs to is what `wrong` checks.
        own = group.stacks.sum { |st| st[:frames].any? { |f| f.label == "Taggers.burn_#{index}" } ? st[:samples] : 0 }
        expect(own).to be >= 0.4 * group.samples
      end
      expect(wrong).to eq(0)
      # A burn always runs inside its tag block: one sampled without tags lost them.
      untagged = groups[nil]&.stacks || []
      lost = untagged.sum { |st| st[:frames].any? { |f| f.label.start_with?("Taggers.burn_") } ? st[:samples] : 0 }
      expect(lost).to be <= 0.01 * profile.samples
    end
  end

  # The same four Ractors sampled in the kernel: the program reads each thread's table
  # through its native thread's pointer, which a thread's resume re-syncs under M:N.
  it "reads each Ractor's own tags in the kernel too, none wrong" do
    skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?
    skip "no rbspy_ext built for #{target_ruby}: run script/rubies ext #{target_ruby.name}" unless target_ruby.extension?

    target = start_target("ractor_tags", env: threads_env)
    profile = record(target.pid, mode: :bpf, rate: 499, duration: 1.5)
    groups = profile.group_by(:job)
    expect(groups.keys.compact.sort).to eq(%w[r0 r1 r2 r3])
    groups.each do |job, group|
      next if job.nil?

      index = job.delete_prefix("r")
      expect(group.threads.map { |t| [t[:name], t[:ractor_name]] }.uniq).to eq([["tagger-#{index}", "tag-#{index}"]])
      others = group.stacks.sum do |st|
        st[:frames].any? { |f| f.label =~ /Taggers\.burn_(\d)\z/ && Regexp.last_match(1) != index } ? st[:samples] : 0
      end
      expect(others).to eq(0)
    end
  end

  # Ractors that start and end during a recording, every fourth ending by an exception.
  it "keeps the samples of Ractors that come and go, and counts them in the notes" do
    target = start_target("ractor_churn", env: threads_env)
    profile = record(target.pid, duration: 2)
    churners = profile.threads.select { |t| t[:ractor] > 1 }
    expect(churners.size).to be >= 5, churners.inspect
    expect(churners.map { |t| t[:ractor_name] }).to all(match(/\Achurn-\d+\z/))
    expect(profile.share("Churn.churn_work")).to be > 0.2
    # A Ractor's thread caught while it starts or ends is dropped, counted (some 1 %).
    expect(profile.errors.values.sum).to be <= 0.05 * profile.samples, profile.errors.inspect
    note = profile.notes.grep(/Ractors besides the main one/).first
    expect(note).not_to be_nil, profile.notes.inspect
    sampled, ended = note.scan(/\d+/).map(&:to_i)
    expect(sampled).to eq(churners.map { |t| t[:ractor] }.uniq.size), note
    expect(ended).to be >= sampled - 2, note # at most two are alive at the end
    expect(RubySpyTest.process_problems(target.pid)).to be_empty
  end
end
