# frozen_string_literal: true

require_relative "spec_helper"
require "fileutils"
require "open3"
require "tmpdir"
require "rbspy_ext"

# `require "rbspy_ext/minitest"`: real Minitest runs of the project in
# spec/fixtures/minitest_project, each in a subprocess inside a copy of the project.
RSpec.describe "the Minitest integration" do
  include RubySpyTest::Projects

  around do |example|
    RubySpyTest::Projects.in_copy_of("minitest_project") do |dir|
      @dir = dir
      example.run
    end
  end

  before { skip "the extension is built for the host Ruby" unless RubySpyTest::TargetRuby.current.host? }

  def minitest(file, *args, env: {})
    clean = { "RUBYSPY" => nil, "RUBYSPY_DIR" => nil, "RUBYSPY_FORMAT" => nil, "RUBYSPY_RATE" => nil,
              "RUBYSPY_SAMPLE" => nil, "RUBYSPY_STATE_LEAVES" => nil, "TEST_ENV_NUMBER" => nil,
              "RUBYSPY_ALLOCATIONS" => nil, "RUBYSPY_ALLOCATION_RATE" => nil }
    out, err, status = Open3.capture3(clean.merge(env), RbConfig.ruby, "-I", File.join(RubySpyTest::ROOT, "lib"),
                                      file, *args, chdir: @dir)
    expect(status.success?).to be(true), "#{out}\n#{err}"
    out
  end

  it "does nothing unless asked" do
    out = minitest("test/work_test.rb")
    expect(out).to include("3 runs, 3 assertions, 0 failures")
    expect(Dir.exist?(File.join(@dir, "tmp"))).to be(false)
  end

  it "RUBYSPY=1 records the run, tags samples by test, and prints the top functions after Minitest's report" do
    out = minitest("test/work_test.rb", env: { "RUBYSPY" => "1" })
    expect(out).to match(/3 runs, 3 assertions, 0 failures.*rubyspy: the suite, \d+ samples at 999 Hz/m)
    expect(written).to eq(%w[suite.raw suite.speedscope.json suite.svg])
    top = out.lines.drop_while { |l| !l.include?("self%  total%") }.drop(1).join
    expect(top).to include("Work.crunch (work.rb)", "Work.shuffle_letters (work.rb)")
    by_test = RubySpy::Profile.load(path("suite.raw")).group_by(:example)
    expect(by_test.keys).to include("WorkTest#test_crunch", "WorkTest#test_shuffle_letters", "WorkTest#test_quick")
    expect(by_test["WorkTest#test_crunch"].share("Work.crunch")).to be > 0.8
    expect(by_test["WorkTest#test_crunch"].share("Work.shuffle_letters")).to eq(0.0)
    expect(by_test["WorkTest#test_shuffle_letters"].share("Work.shuffle_letters")).to be > 0.8
  end

  it "RUBYSPY_ALLOCATIONS=1 tracks the run's allocations, writes them and prints the lines that allocate most" do
    out = minitest("test/work_test.rb", env: { "RUBYSPY_ALLOCATIONS" => "1" })
    expect(written).to eq(%w[suite.allocs.pb.gz suite.allocs.txt])
    head = out.lines.drop_while { |l| !l.start_with?("rubyspy: allocations of the suite") }
    expect(head.first).to match(/one sample per 524288 bytes\), written to tmp\/rubyspy\/suite\.allocs\.pb\.gz/)
    # Work.shuffle_letters makes a String a turn, for half a second: nearly all of it.
    expect(head[2]).to match(/\A\s+\d+\s+\d+  work\.rb:\d+ Work\.shuffle_letters \(String#reverse\)$/)
    expect(File.read(path("suite.allocs.txt"))).to match(%r{work\.rb:\d+ String#reverse})
  end

  it "RUBYSPY=1's report shows waits for the GVL as a row of their own, unless RUBYSPY_STATE_LEAVES=0" do
    row = ->(out, name) { out.lines.find { |l| l.match?(/\A\s*[\d.]+%\s+[\d.]+%  #{Regexp.escape(name)}/) } }
    out = minitest("test/contend_test.rb", env: { "RUBYSPY" => "1" })
    suite = RubySpy::Profile.load(path("suite.raw"))
    waited = suite.samples_in(:waiting_for_gvl)
    busy = suite.samples - suite.samples_in(:blocked)
    expect(waited).to be > 0.2 * busy # two threads after one GVL
    printed = row.(out, "[waiting for GVL]") or raise out
    expect(printed[/[\d.]+/].to_f).to be_within(0.051).of(100.0 * waited / busy)
    expect(printed.chomp).to end_with("[waiting for GVL]") # a state: no file, no "(C function)"

    bare = minitest("test/contend_test.rb", env: { "RUBYSPY" => "1", "RUBYSPY_STATE_LEAVES" => "0" })
    expect(row.(bare, "[waiting for GVL]")).to be_nil
    expect(row.(bare, "Work.crunch")).not_to be_nil
  end

  it "RUBYSPY_SAMPLE profiles that many tests, the same ones for the same seed" do
    env = { "RUBYSPY_SAMPLE" => "2", "RUBYSPY_FORMAT" => "raw" }
    minitest("test/work_test.rb", "--seed", "1234", env: env)
    picked = written("examples")
    expect(picked.size).to eq(2)
    expect(picked).to all(match(/\AWorkTest-test_\w+\.raw\z/))
    own_code = { "test_crunch" => "Work.crunch", "test_shuffle_letters" => "Work.shuffle_letters",
                 "test_quick" => "Work.crunch" }
    picked.each do |file|
      profile = RubySpy::Profile.load(path("examples", file))
      test = file.delete_suffix(".raw").sub("-", "#")
      expect(profile.tags.map { |t| t[:tags] }).to all(include(example: test))
      labels = profile.stacks.flat_map { |s| s[:frames].map(&:label) }
      expect(labels).to include(own_code.fetch(test.split("#").last)), test
    end
    FileUtils.rm_rf(path)
    minitest("test/work_test.rb", "--seed", "1234", env: env)
    expect(written("examples")).to eq(picked)
  end

  it "under parallel_tests (TEST_ENV_NUMBER) each process writes suite.<number>.*" do
    minitest("test/work_test.rb", env: { "RUBYSPY" => "1", "TEST_ENV_NUMBER" => "" })
    minitest("test/work_test.rb", env: { "RUBYSPY" => "1", "TEST_ENV_NUMBER" => "2" })
    expect(written).to eq(%w[suite.1.raw suite.1.speedscope.json suite.1.svg
                             suite.2.raw suite.2.speedscope.json suite.2.svg])
    %w[1 2].each do |n|
      expect(RubySpy::Profile.load(path("suite.#{n}.raw")).group_by(:example).keys).to include("WorkTest#test_crunch")
    end
  end

  it "leaves the other Minitest plugins loading (minitest's own pride plugin)" do
    # minitest <= 5.20 loads no plugin once Minitest.extensions is not empty: --pride was then
    # an invalid option (exit 1).
    out = minitest("test/work_test.rb", "--pride", env: { "RUBYSPY" => "1" })
    expect(out).to include("3 runs, 3 assertions, 0 failures")
    expect(written).to eq(%w[suite.raw suite.speedscope.json suite.svg])
  end

  it "under Rails' parallelize, RUBYSPY_SAMPLE still profiles the picked tests in the workers" do
    out = minitest("test/parallel_test.rb", "--seed", "7", env: { "RUBYSPY_SAMPLE" => "2", "RUBYSPY_FORMAT" => "raw",
                                                                  "PARALLEL_WORKERS" => "2" })
    expect(out).to include("4 runs, 4 assertions, 0 failures")
    expect(written("examples")).to match([a_string_matching(/\AParallelTest-test_crunch_\d\.raw\z/)] * 2)
  end

  it "under Rails' parallelize each forked worker writes suite.<worker>.* with its own tests" do
    out = minitest("test/parallel_test.rb", env: { "RUBYSPY" => "1", "PARALLEL_WORKERS" => "2" })
    expect(out).to include("4 runs, 4 assertions, 0 failures")
    expect(written).to include("suite.0.raw", "suite.1.raw", "suite.raw")
    tests = %w[0 1].flat_map do |worker|
      by_test = RubySpy::Profile.load(path("suite.#{worker}.raw")).group_by(:example)
      names = by_test.keys.compact
      names.each { |name| expect(by_test[name].share("Work.crunch")).to be > 0.5 }
      names
    end
    expect(tests.sort).to eq((0..3).map { |i| "ParallelTest#test_crunch_#{i}" })
  end
end
