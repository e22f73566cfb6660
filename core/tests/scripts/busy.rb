# Keeps the GVL busy changing its stack, to exercise reads that race the target.
def spin(n)
  n.zero? ? [1, 2, 3].map { |x| x * 2 }.sum : spin(n - 1)
end
File.write(ARGV[0], "ready\n")
i = 0
loop { spin(i % 40); i += 1 }
