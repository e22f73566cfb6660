# frozen_string_literal: true

module RubySpyTest
  # Runs fixtures with one Ruby executable, as users start it (a static source build, or a
  # copy of one: stripped, compressed, split from its debug file), where TargetRuby runs the
  # matrix's Rubies.
  BinaryRuby = Struct.new(:bin) do
    def command(*args)
      [bin, *args]
    end

    def mktmpdir(prefix)
      [Dir.mktmpdir(prefix)] * 2
    end

    def to_s
      bin
    end
  end
end
