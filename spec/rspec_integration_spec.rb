# frozen_string_literal: true

require_relative "spec_helper"
require "fileutils"
require "json"
require "open3"
require "rexml/document"
require "tmpdir"
require "zlib"
require "rbspy_ext"

# `require "rbspy_ext/rspec"`: real RSpec runs of the project in spec/fixtures/rspec_project,
# each in a subprocess inside a copy of the project, and the files they leave behind.
RSpec.describe "the RSpec integration" do
  include RubySpyTest::Recording
  include RubySpyTest::GoPprof

  RUNNER = 'require "rspec/core"; exit RSpec::Core::Runner.run(ARGV)'

  include RubySpyTest::Projects

  around do |example|
    RubySpyTest::Projects.in_copy_of("rspec_project") do |dir|
      @dir = dir
      example.run
    end
  end

  Run = Struct.new(:out, :err, :status, :results, keyword_init: true) do
    # Each example's status and failure message, by description.
    def examples
      results.fetch("examples").to_h do |e|
        [e.fetch("description"), [e.fetch("status"), e.dig("exception", "message")]]
      end
    end

    def summary
      results.fetch("summary").values_at("example_count", "failure_count")
    end
  end

  def rspec(*args, env: {})
    json = File.join(@dir, "results.json")
    out, err, status = Open3.capture3(
      { "RUBYSPY" => nil, "RUBYSPY_DIR" => nil, "RUBYSPY_FORMAT" => nil, "RUBYSPY_RATE" => nil,
        "RUBYSPY_SAMPLE" => nil, "RUBYSPY_STATE_LEAVES" => nil, "RUBYSPY_ALLOCATIONS" => nil,
        "RUBYSPY_ALLOCATION_RATE" => nil }.merge(env),
      RbConfig.ruby, "-I", File.join(RubySpyTest::ROOT, "lib"), "-e", RUNNER, "--",
      "--require", "rbspy_ext/rspec", "--format", "progress", "--format", "json", "--out", json, *args,
      chdir: @dir
    )
    results = File.exist?(json) ? JSON.parse(File.read(json)) : {}
    Run.new(out: out, err: err, status: status, results: results)
  end

  def speedscope_frames(file)
    JSON.parse(File.read(file)).fetch("shared").fetch("frames").map { |f| f.fetch("name") }
  end

  it "does nothing unless asked: no files, no extension loaded" do
    probe = File.join(@dir, "probe")
    run = rspec("spec/profiled_check.rb", "-e", "says whether", env: { "PROBE" => probe })
    expect(run.summary).to eq([1, 0]), run.err
    expect(File.read(probe)).to eq("0")
    expect(Dir.exist?(File.join(@dir, "tmp"))).to be false
  end

  it "writes one profile per :rubyspy example, named from its id, overwritten on a rerun" do
    run = rspec("spec/profiled_check.rb")
    # The user's own results are untouched: one example fails on its own account.
    expect(run.summary).to eq([5, 1])
    expect(run.examples["fails, and is still profiled"][0]).to eq("failed")
    names = %w[spec-profiled_check.rb-1-1.speedscope.json spec-profiled_check.rb-1-2.pb.gz
               spec-profiled_check.rb-1-4.speedscope.json]
    expect(written("examples")).to eq(names)
    expect(run.out).to include("rubyspy: 3 example profiles in tmp/rubyspy/examples/")

    crunch = speedscope_frames(path("examples", names[0]))
    expect(crunch).to include("Work.crunch")
    expect(crunch).not_to include("Work.shuffle_letters") # only the example's own samples
    expect(pprof_functions(path("examples", names[1]))).to include("Work.shuffle_letters")
    expect(speedscope_frames(path("examples", names[2]))).to include("Work.crunch")

    rspec("spec/profiled_check.rb")
    expect(written("examples")).to eq(names)
  end

  it "RUBYSPY=1 records the suite, prints its slowest functions, and tags samples by example" do
    run = rspec("spec/suite_check.rb", env: { "RUBYSPY" => "1" })
    expect(run.summary).to eq([5, 0]), run.err
    expect(written).to eq(%w[suite.raw suite.speedscope.json suite.svg])
    expect(run.out).to match(/^rubyspy: the suite, \d+ samples at 999 Hz/)
    top = run.out.lines.drop_while { |l| !l.include?("self%  total%") }.drop(1).first(10)
    expect(top.size).to eq(10)
    expect(top).to all(match(/\A\s+\d+\.\d% +\d+\.\d%  \S/))
    expect(top.join).to include("Work.crunch").and include("Work.shuffle_letters")

    expect(speedscope_frames(path("suite.speedscope.json"))).to include("Work.crunch", "Work.shuffle_letters")
    svg = REXML::Document.new(File.read(path("suite.svg")))
    expect(svg.root.name).to eq("svg")
    expect(REXML::XPath.match(svg, "//title").map(&:text).join("\n")).to include("Work.crunch")

    by_example = RubySpy::Profile.load(path("suite.raw")).group_by(:example)
    first, second = "./spec/suite_check.rb[1:1]", "./spec/suite_check.rb[1:2]"
    expect(by_example.keys).to include(first, second)
    expect(by_example[first].share("Work.crunch")).to be > 0.8
    expect(by_example[first].share("Work.shuffle_letters")).to eq(0.0)
    expect(by_example[second].share("Work.shuffle_letters")).to be > 0.8
    expect(by_example[second].samples).to be_within(by_example[second].samples / 2).of(by_example[first].samples)
  end

  it "rubyspy: { allocations: true } writes an example's every allocation, and what it kept, as Go's profile" do
    run = rspec("spec/allocs_check.rb")
    expect(run.summary).to eq([2, 0]), run.err
    expect(written("examples")).to eq(%w[spec-allocs_check.rb-1-1.allocs.pb.gz spec-allocs_check.rb-1-1.allocs.txt])
    expect(run.out).to include("rubyspy: 1 example profile in tmp/rubyspy/examples/")
    pb = path("examples", "spec-allocs_check.rb-1-1.allocs.pb.gz")
    # Rate 1: exact. Each of 5,000 turns makes a temporary String and a kept one; after the
    # example's GC only the kept ones are in use.
    allocated = go_pprof("-top", "-cum", "-sample_index=alloc_objects", "-focus=Work.keep_strings", pb)
    expect(allocated).to match(/^\s*\d+\s+[\d.]+%\s+[\d.]+%\s+10000\s+[\d.]+%\s+Work\.keep_strings$/)
    kept = go_pprof("-top", "-cum", "-sample_index=inuse_objects", "-focus=Work.keep_strings", pb)
    expect(kept).to match(/^\s*\d+\s+[\d.]+%\s+[\d.]+%\s+5000\s+[\d.]+%\s+Work\.keep_strings$/)
    expect(pprof_functions(pb)).not_to include("Work.make_garbage") # not tracked
    text = File.read(path("examples", "spec-allocs_check.rb-1-1.allocs.txt"))
    lines = File.readlines(File.join(@dir, "work.rb"))
    temporary, kept_line = ['"temporary".dup', 'KEPT << "kept".dup'].map { |code| lines.index { |l| l.include?(code) } + 1 }
    expect(text).to match(/^Allocated: \d+ objects/)
    expect(text).to match(/work\.rb:#{temporary} Kernel#dup/).and match(/work\.rb:#{kept_line} Kernel#dup/)
  end

  it "RUBYSPY_ALLOCATIONS=1 tracks the suite's allocations, prints the lines that allocate most, writes them" do
    run = rspec("spec/allocs_check.rb", env: { "RUBYSPY_ALLOCATIONS" => "1", "RUBYSPY_ALLOCATION_RATE" => "4096" })
    expect(run.summary).to eq([2, 0]), run.err
    expect(written).to eq(%w[suite.allocs.pb.gz suite.allocs.txt])
    expect(run.err).to include("RUBYSPY_ALLOCATIONS tracks the whole suite: no example tracks its own")
    head = run.out.lines.drop_while { |l| !l.start_with?("rubyspy: allocations of the suite") }
    expect(head.first).to match(/\d+ objects, \d+ bytes of slots \(one sample per 4096 bytes\), written to /)
    top = head.drop(2).first(2).join
    # 100,000 Strings of garbage, then 10,000 of which half are kept.
    expect(head[2]).to match(%r{\A\s+\d+\s+\d+  work\.rb:\d+ Work\.make_garbage}), top
    expect(head.drop(2).first(5).join).to include("Work.keep_strings")
    expect(pprof_functions(path("suite.allocs.pb.gz"))).to include("Work.make_garbage", "Work.keep_strings")
  end

  it "10 ms examples get samples of their own code, 20 of 20" do
    run = rspec("spec/short_check.rb", "-e", "crunches for 10 ms")
    expect(run.summary).to eq([20, 0]), run.err
    files = (1..20).map { |i| path("examples", "spec-short_check.rb-1-#{i}.raw") }
    counts = files.map do |f|
      RubySpy::Profile.load(f).stacks.select { |s| s[:frames].any? { |fr| fr.label == "Work.crunch" } }
                                    .sum { |s| s[:samples] }
    end
    expect(counts).to all(be >= 1), counts.inspect # about 10 each on a quiet machine (999 Hz)
  end

  it "a per-example profile has the example's other threads, named by the example" do
    run = rspec("spec/short_check.rb", "-e", "waits while its server works")
    expect(run.summary).to eq([1, 0]), run.err
    profile = RubySpy::Profile.load(path("examples", "spec-short_check.rb-1-21-1.raw"))
    expect(profile.threads.map { |t| t[:name] }).to include("server")
    expect(profile.share("Work.serve_request")).to be > 0.3
    id = "./spec/short_check.rb[1:21:1]"
    expect(profile.tags.map { |t| t[:tags] }).to all(include(example: id))
  end

  it "RUBYSPY=1's summary counts before(:suite) work and every thread, as Profile#functions does" do
    run = rspec("spec/short_check.rb", "-e", "waits while its server works", env: { "RUBYSPY" => "1" })
    expect(run.summary).to eq([1, 0]), run.err
    suite = RubySpy::Profile.load(path("suite.raw"))
    expect(suite.share("Work.crunch_in_setup")).to be > 0.02 # before(:suite): 0.3 s of the run
    expect(suite.share("Work.serve_request")).to be > 0.02 # the server thread, which has no example tag
    top = run.out.lines.drop_while { |l| !l.include?("self%  total%") }.drop(1).first(10)
    printed = top.map { |l| l[/\A\s*[\d.]+%\s+[\d.]+%  (.+?)(?: \([^)]*\))?\n?\z/, 1] }
    expect(printed).to eq(suite.functions(limit: 10, idle: false).map { |f| f[:label] }), top.join
    expect(top.join).to match(/ \(C function\)$/)
  end

  # The summary's rows: label => self%, as printed.
  def summary_self(out)
    rows = out.lines.drop_while { |l| !l.include?("self%  total%") }.drop(1).take_while { |l| l.match?(/\A\s*\d/) }
    rows.to_h { |l| l.match(/\A\s*([\d.]+)%\s+[\d.]+%  (.+?)(?: \([^)]*\))?\n?\z/).captures.reverse }
        .transform_values(&:to_f)
  end

  it "RUBYSPY=1 shows waits for the GVL as a row and a frame of their own; RUBYSPY_STATE_LEAVES=0 does not" do
    run = rspec("spec/contend_check.rb", env: { "RUBYSPY" => "1" })
    expect(run.summary).to eq([1, 0]), run.err
    suite = RubySpy::Profile.load(path("suite.raw"))
    busy = suite.samples - suite.samples_in(:blocked)
    share = ->(n) { 100.0 * n / busy }
    waited = suite.samples_in(:waiting_for_gvl)
    expect(waited).to be > 0.2 * busy # two threads after one GVL
    rows = summary_self(run.out)
    expect(rows["[waiting for GVL]"]).to be_within(0.051).of(share.(waited)), run.out
    # Work.crunch's own row holds the samples it ran in, nothing else.
    ran = suite.select(state: :running).functions.find { |f| f[:label] == "Work.crunch" }
    expect(rows["Work.crunch"]).to be_within(0.051).of(share.(ran[:self])), run.out
    expect(speedscope_frames(path("suite.speedscope.json"))).to include("[waiting for GVL]")

    bare = rspec("spec/contend_check.rb", env: { "RUBYSPY" => "1", "RUBYSPY_STATE_LEAVES" => "0" })
    expect(bare.summary).to eq([1, 0]), bare.err
    expect(summary_self(bare.out).keys.grep(/\A\[/)).to eq([]), bare.out
    expect(speedscope_frames(path("suite.speedscope.json"))).not_to include("[waiting for GVL]")
  end

  it "RUBYSPY=boot records only the load of the suite" do
    run = rspec("spec/profiled_check.rb", "-e", "is not profiled",
                env: { "RUBYSPY" => "boot", "LOAD_SECONDS" => "0.4" })
    expect(run.summary).to eq([1, 0]), run.err
    expect(written).to eq(%w[boot.raw boot.speedscope.json boot.svg])
    boot = RubySpy::Profile.load(path("boot.raw"))
    expect(boot.share("Work.load_time_setup")).to be > 0.5
    expect(boot.share("Work.shuffle_letters")).to eq(0.0) # the examples ran after it
    expect(run.out).to include("rubyspy: the load of the suite")
  end

  it "RUBYSPY_SAMPLE profiles that many random examples, the same ones again for the same seed" do
    env = { "RUBYSPY_SAMPLE" => "2", "RUBYSPY_FORMAT" => "collapsed" }
    rspec("spec/suite_check.rb", "--seed", "1234", env: env)
    picked = written("examples")
    expect(picked.size).to eq(2)
    expect(picked).to all(match(/\Aspec-suite_check\.rb-1-\d\.collapsed\.txt\z/))
    picked.each do |name|
      stacks = RubySpyTest::Recording.parse_collapsed(File.read(path("examples", name)))
      expect(stacks).not_to be_empty
    end
    FileUtils.rm_rf(path)
    rspec("spec/suite_check.rb", "--seed", "1234", env: env)
    expect(written("examples")).to eq(picked)
  end

  it "honours RUBYSPY_DIR and RUBYSPY_RATE" do
    run = rspec("spec/suite_check.rb", "-e", "crunches",
                env: { "RUBYSPY" => "1", "RUBYSPY_DIR" => "out/prof", "RUBYSPY_RATE" => "199" })
    expect(run.out).to match(/rubyspy: the suite, \d+ samples at 199 Hz/)
    expect(Dir.children(File.join(@dir, "out", "prof")).sort).to eq(%w[suite.raw suite.speedscope.json suite.svg])
  end

  describe "problems of its own" do
    it "warns once about an unwritable directory and leaves the results alone" do
      run = rspec("spec/suite_check.rb", env: { "RUBYSPY" => "1", "RUBYSPY_DIR" => "/proc/nope" })
      expect(run.summary).to eq([5, 0])
      expect(run.status.exitstatus).to eq(0)
      warnings = run.err.lines.grep(/^rubyspy:/)
      expect(warnings.size).to eq(1), run.err
      expect(warnings.first).to include("/proc/nope").and include("RUBYSPY_DIR")
    end

    it "warns about an unknown format or rate and uses the defaults" do
      run = rspec("spec/suite_check.rb", "-e", "crunches",
                  env: { "RUBYSPY" => "1", "RUBYSPY_FORMAT" => "bogus", "RUBYSPY_RATE" => "-5" })
      expect(run.summary).to eq([1, 0])
      expect(run.err).to include('unknown format bogus in RUBYSPY_FORMAT').and include("RUBYSPY_RATE=-5")
      expect(written).to eq(%w[suite.raw suite.speedscope.json suite.svg])
    end
  end

  describe "spend_at_most(...).percent_in(...)" do
    it "passes and fails on the measured share, and refuses to judge on too few samples" do
      run = rspec("spec/matcher_check.rb")
      results = run.examples
      expect(results["passes when the share is under the bound"]).to eq(["passed", nil])
      expect(results["matches labels by Regexp"]).to eq(["passed", nil])
      expect(results["counts a function anywhere on the stack, not only on top"]).to eq(["passed", nil])

      status, message = results["fails when the share is over the bound"]
      expect(status).to eq("failed")
      expect(message).to match(/expected at most 50% of samples in "Work.crunch", got (9\d|100)\.\d% \(\d+ of \d+ samples; \+\/- \d+\.\d points at 95%\)/)

      status, message = results["refuses to judge on too few samples"]
      expect(status).to eq("failed")
      expect(message).to match(/only \d+ samples of the block at 9999 Hz, fewer than the 100 needed/)
    end

    it "rejects bad arguments with clear errors" do
      expect(rspec("spec/matcher_check.rb", "-e", "rejects bad arguments").examples)
        .to eq("rejects bad arguments" => ["passed", nil])
    end
  end
end
