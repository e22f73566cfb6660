# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "open3"
require "shellwords"
require "tmpdir"

# `rubyspy top` in a real terminal: a tmux session of a given size runs it, keys go in with
# send-keys, and what it drew comes back with capture-pane.
RSpec.describe "rubyspy top" do
  before(:all) { skip "tmux is not installed (script/setup installs it)" unless system("tmux -V", out: File::NULL) }

  before do
    skip "the extension is built for the host Ruby" unless RubySpyTest::TargetRuby.current.host?
    @dir = Dir.mktmpdir("rubyspy-top")
    @session = "rubyspy-top-#{Process.pid}-#{rand(1 << 30)}"
  end

  after do
    system("tmux", "kill-session", "-t", @session, err: File::NULL) if @session
    FileUtils.rm_rf(@dir) if @dir
  end

  let(:status_file) { File.join(@dir, "status") }

  # Starts `rubyspy top ARGS` in a +width+ x +height+ terminal; its exit status and
  # standard error land in files once it ends.
  def start_top(*args, width: 120, height: 30)
    command = rubyspy_command("top", *args).shelljoin
    script = "#{command} 2>#{File.join(@dir, "err").shellescape}; echo $? > #{status_file.shellescape}; sleep 60"
    ok = system("tmux", "new-session", "-d", "-s", @session, "-x", width.to_s, "-y", height.to_s, script)
    raise "tmux new-session failed" unless ok
  end

  def screen
    out, = Open3.capture2("tmux", "capture-pane", "-p", "-t", @session)
    out
  end

  # Waits (up to 15 s) until the screen matches +pattern+; the screen.
  def await(pattern)
    text = nil
    wait_for("the screen to show #{pattern.inspect}", timeout: 15, interval: 0.2, detail: -> { text }) do
      (text = screen).match?(pattern) && text
    end
  end

  def keys(*keys)
    system("tmux", "send-keys", "-t", @session, *keys)
  end

  # The exit status of the command in the terminal (ProcessHelpers#exit_status waits for a
  # child of this process; this one is tmux's).
  def terminal_exit_status
    wait_for("the exit status in #{status_file}", timeout: 10, interval: 0.1) do
      File.exist?(status_file) && !File.read(status_file).empty?
    end
    Integer(File.read(status_file))
  end

  it "shows the functions with %Own, %Total and file:line, sorts on 1-4, and quits on q" do
    target = start_target("named_worker")
    start_top("--pid", target.pid, "--rate", 200)
    text = await(/Crunch#digest/)
    lines = text.lines.map(&:rstrip)
    expect(lines[0]).to match(/\Arubyspy top: pid #{target.pid}, \d+ s, \d+ samples at 200 Hz, sorted by %Own\z/)
    expect(lines[1]).to match(/\AThreads: 2 .*running \d+\.\d%/)
    expect(lines).to include(a_string_matching(/\A +%Own +%Total +Function +File:line\z/))
    digest = lines.find { |l| l.include?("Crunch#digest") }
    spin = fixture_line("named_worker", "spin-start")..fixture_line("named_worker", "spin-end")
    own, total, line = digest.match(/\A +([\d.]+) +([\d.]+) +\S+ +\S*named_worker\.rb:(\d+)\z/)&.captures
    expect(own).not_to be_nil, digest
    expect(Float(own)).to be > 90 # the sleeping main thread is left out
    expect(Float(total)).to be >= Float(own)
    expect(spin).to include(Integer(line))
    expect(lines).not_to include(a_string_matching(/Kernel#sleep/))

    keys("2")
    await(/sorted by %Total/)
    keys("3")
    text = await(/sorted by Function/)
    labels = text.lines.drop_while { |l| !l.include?("%Own") }.drop(1).take_while { |l| !l.start_with?("Keys:") }
                 .map { |l| l.split(/\s{2,}/)[2] }.compact
    expect(labels).to eq(labels.sort)
    keys("q")
    expect(terminal_exit_status).to eq(0)
  end

  it "shows waits for the GVL as a row of their own, not as the spinning method's, unless --no-state-leaves" do
    target = start_target("gvl_contention")
    start_top("--pid", target.pid, "--rate", 200)
    text = await(/\[waiting for GVL\].*\(thread state\)\s*$/)
    # Two spinners after one GVL: each runs half its samples and waits the other half.
    own = ->(t, name) { t.lines.find { |l| l.include?(name) }&.match(/\A +([\d.]+) +[\d.]+ /)&.captures&.first.to_f }
    expect(own.(text, "[waiting for GVL]")).to be_between(25, 75), text
    expect(own.(text, "Contender#spin")).to be_between(25, 75), text
    keys("q")
    expect(terminal_exit_status).to eq(0)
    system("tmux", "kill-session", "-t", @session, err: File::NULL)
    File.delete(status_file)

    start_top("--pid", target.pid, "--rate", 200, "--no-state-leaves")
    text = await(/Contender#spin/)
    expect(text).not_to include("[waiting for GVL]")
    expect(own.(text, "Contender#spin")).to be > 90
    keys("q")
    expect(terminal_exit_status).to eq(0)
  end

  it "adds a line per Ractor once threads of other Ractors run, with each one's share running" do
    target = start_target("ractor_spinners")
    start_top("--pid", target.pid, "--rate", 200)
    text = await(/ractor \d+ \(spin-b\)/)
    %w[a b].each do |x|
      line = text.lines.find { |l| l.include?("(spin-#{x})") }
      running = line&.match(/\A  ractor \d+ \(spin-#{x}\): 1 thread, running ([\d.]+)%/)&.captures&.first
      expect(running).not_to be_nil, text
      expect(Float(running)).to be > 90
    end
    expect(text).to match(/^  main ractor: 1 thread, running 0\.0%/)
    expect(text).to include("Spinners.spin_a")
    keys("q")
    expect(terminal_exit_status).to eq(0)
  end

  it "shows each thread's current tags, and the blocked threads with --idle" do
    target = start_target("tagged")
    start_top("--pid", target.pid, "--idle")
    text = await(/Kernel#sleep/)
    expect(text).to include("Tags of main: request_id=req-#{target.pid} user=7")
    expect(text).to include("Tags of tagged-worker: job=nightly-report attempt=3")
    keys("C-c")
    expect(terminal_exit_status).to eq(0)
  end

  it "fits a narrow terminal: no line wider than it, long labels cut" do
    target = start_target("named_worker")
    start_top("--pid", target.pid, width: 50, height: 20)
    text = await(/Crunch#dig/)
    expect(text.lines.map { |l| l.chomp.size }.max).to be <= 50
    expect(text).to match(/…/)
    keys("q")
    expect(terminal_exit_status).to eq(0)
  end

  it "says so and exits 0 when the process exits" do
    target = start_target("named_worker")
    start_top("--pid", target.pid)
    await(/Crunch#digest/)
    target.stop
    expect(terminal_exit_status).to eq(0)
    expect(File.read(File.join(@dir, "err"))).to match(/\Arubyspy: process #{target.pid} exited after [\d.]+ s/)
  end

  it "record's live view fits the terminal too" do
    target = start_target("named_worker")
    output = File.join(@dir, "out.svg")
    command = rubyspy_command("record", "--pid", target.pid, "-d", 3, "-o", output).shelljoin
    system("tmux", "new-session", "-d", "-s", @session, "-x", "40", "-y", "15",
           "#{command}; echo $? > #{status_file.shellescape}; sleep 60") or raise "tmux failed"
    text = await(/Crunch#digest/)
    lines = text.lines.map(&:chomp).reject(&:empty?)
    expect(lines.first).to start_with("recording pid #{target.pid}:").and end_with("…")
    expect(lines.map(&:size).max).to be <= 40
    expect(lines.count { |l| l.start_with?("recording pid") }).to eq(1) # redrawn in place
    expect(terminal_exit_status).to eq(0)
  end

  it "without a terminal is a usage error (exit 2)" do
    target = start_target("named_worker")
    run = rubyspy!("top", "--pid", target.pid, stdin_data: "", exitstatus: 2)
    expect(run.stderr).to eq("rubyspy: top needs a terminal (it redraws in place); use rubyspy record for a file\n")
  end
end
